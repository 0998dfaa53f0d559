"""The reliability harness (see `polylane.bench.soak`): a real server under saturation, admin faults,
broken model files and a SIGTERM mid-load; every request must end in an answer or a clear error.

Run:  python bench/soak.py [--clients 32] [--seconds 180] [--models a,b,c] [--dtype auto]
      [--kv-tokens 1024] [--disconnect 0.15] [--admin-every 5] [--cycles 6] [--seed 0] [--workdir DIR]
"""

from polylane.bench.soak import main

if __name__ == "__main__":
    main()
