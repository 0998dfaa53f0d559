"""What an idle thread that once ran torch ops costs the thread that computes.

Run:  python bench/thread_teams.py [--threads 2] [--idle 0 1 2]

Streams forty 576×3072 float32 matrices (280 MB, out of cache) through one-row matmuls — the shape
of batch-1 decode — in the main thread, first alone, then while N other threads that have each
run the same matmuls stay alive (blocked on an event), then after they exit. Each such thread owns
an OpenMP team while it lives; with more OpenMP threads than CPUs libgomp puts idle workers to
sleep instead of spinning, and every parallel op then pays a wake-up. This is why the engine's
loader thread ends after each load (`polylane/runtime/loading/load_thread.py`).
"""

from __future__ import annotations

import argparse
import threading
import time

import torch


def microseconds_per_matrix(x: torch.Tensor, weights: list[torch.Tensor], repeats: int = 20) -> float:
    for _ in range(3):
        for w in weights:
            x @ w
    started = time.perf_counter()
    for _ in range(repeats):
        for w in weights:
            x @ w
    return (time.perf_counter() - started) / (repeats * len(weights)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--idle", type=int, nargs="+", default=[0, 1, 2], help="idle threads to keep alive")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = [torch.randn(576, 3072) for _ in range(40)]
    x = torch.randn(1, 576)
    for count in args.idle:
        release = threading.Event()
        ready = threading.Barrier(count + 1)

        def idle_thread(ready: threading.Barrier, release: threading.Event) -> None:
            microseconds_per_matrix(x, weights[:4], repeats=2)  # gives this thread an OpenMP team
            ready.wait()
            release.wait()

        threads = [threading.Thread(target=idle_thread, args=(ready, release)) for _ in range(count)]
        for thread in threads:
            thread.start()
        ready.wait()
        during = microseconds_per_matrix(x, weights)
        release.set()
        for thread in threads:
            thread.join()
        after = microseconds_per_matrix(x, weights)
        print(f"{count} idle threads alive: {during:6.1f} us per matrix; after they exit: {after:6.1f} us")


if __name__ == "__main__":
    main()
