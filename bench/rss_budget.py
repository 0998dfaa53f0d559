"""How the process's resident memory relates to the residency budget's accounting.

Run:  python bench/rss_budget.py [--models a,b,...] [--dtype auto] [--kv-tokens 4096] [--budget 2.5GiB]

Registers the models (the four catalogue models by default) with one `ResidencyManager`, loads
them one after another (each kept resident, none evicted: the budget must hold them all) and runs a
400-token prompt through each, so that every weight page and the KV path has been touched. After
each model it reports the process's RSS and the bytes residency accounts for (`used_bytes`:
weights + KV reservations), and per model what its load added to RSS against what it is
accounted. The difference is what residency does not count: the interpreter and libraries (torch,
tokenizers, the native kernels), each model's tokenizer and the run's transient buffers. Prints a
table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json

import psutil

MODELS = (
    "smollm2-135m-instruct",
    "gemma3-270m",
    "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-coder-1.5b-instruct",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-tokens", type=int, default=4096)
    parser.add_argument("--budget", default="2.5GiB", help="sizes as serve's --budget (MiB in the table)")
    args = parser.parse_args()

    process = psutil.Process()
    import torch  # noqa: F401 (imported before the first measurement: part of the baseline)

    from polylane.runtime.kv.model_kv import Extend
    from polylane.runtime.loading.model_record import resolve_record
    from polylane.runtime.residency.manager import ResidencyManager
    from polylane.server.config import parse_size

    baseline = process.memory_info().rss
    manager = ResidencyManager(parse_size(args.budget, lambda: 0), quiet=True)
    names = args.models.split(",")
    for name in names:
        manager.register(resolve_record(name, dtype=args.dtype, kv_tokens=args.kv_tokens))
    rows, leases = [], []
    for name in names:
        before = process.memory_info().rss
        lease = manager.acquire(name)
        prompt = tuple(lease.model.tokenizer.encode("The capital of France is " * 70))[:400]
        sequence = lease.kv.open(prompt)
        lease.kv.forward([Extend(sequence, prompt[sequence.num_tokens :])])
        lease.kv.close(sequence, cache=False)
        leases.append(lease)
        gc.collect()
        after = process.memory_info().rss
        accounted = next(info.bytes for info in manager.snapshot() if info.name == name)
        used = manager.counters().pool.used_bytes
        rows.append(
            {
                "model": name,
                "accounted_mib": accounted / 2**20,
                "rss_added_mib": (after - before) / 2**20,
                "used_mib": used / 2**20,
                "rss_mib": after / 2**20,
                "unaccounted_mib": (after - used) / 2**20,
            }
        )
    states = {info.name: info.state for info in manager.snapshot()}
    print(f"baseline RSS (python, torch imported): {baseline / 2**20:.0f} MiB; budget {args.budget}")
    print("| after loading | accounted (MiB) | RSS added | used_bytes | RSS | RSS − used_bytes |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['model']} | {row['accounted_mib']:.0f} | {row['rss_added_mib']:.0f} "
            f"| {row['used_mib']:.0f} | {row['rss_mib']:.0f} | {row['unaccounted_mib']:.0f} |"
        )
    last = rows[-1]
    print(
        f"all resident: {all(s == 'resident' for s in states.values())}; RSS = used_bytes × "
        f"{last['rss_mib'] / last['used_mib']:.3f}; RSS − used_bytes − baseline = "
        f"{last['unaccounted_mib'] - baseline / 2**20:.0f} MiB"
    )
    print(json.dumps({"baseline_mib": baseline / 2**20, "rows": rows, "states": states}))
    for lease in leases:
        lease.release()
    manager.close()


if __name__ == "__main__":
    main()
