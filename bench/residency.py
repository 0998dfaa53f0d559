"""Residency benchmark: warm acquire latency, cold load time per model, and the hit rate of a Zipf
request stream over the four catalogue models under one byte budget, LRU vs cost-aware eviction.

Run:  python bench/residency.py [--dtype auto|bf16|fp32] [--threads 2] [--repeats 3]
      [--iterations 20000] [--requests 2000] [--zipf-s 1.1] [--seed 0] [--budget-fraction 0.5]
      [--real-requests 40] [--kv-tokens 4096] [--models a,b,...]

Metrics:
- Loads (one `ResidencyManager` with room for everything, one model at a time, evicted after each):
  - gguf_mb: size of the model's GGUF file (MB = 10^6 bytes).
  - first_load: how this process's first load of the model read its weights: "conversion" (no
    converted file at this dtype existed before: the GGUF was dequantised and the result written
    to the converted cache, `polylane.runtime.loading.converted`) or "converted cache" (a converted
    safetensors file existed and was read back). Checked before the load.
  - first_load_s: seconds of that first load (weights, tokenizer, KV reservation: the manager's
    measured `load_seconds`; fetching the file is not included). first_mb_per_s = gguf_mb / first_load_s.
  - reload_s: median (and best) of --repeats later loads, each from the converted cache; the file
    is in the OS page cache by then, so this is memory bandwidth and copying, not disk.
    converted_mb: size of that file; reload_mb_per_s = converted_mb / median reload_s.
  - resident_mb: the bytes the model counts against the budget, measured after loading (weights
    at the dtype + its KV cache reservation of --kv-tokens tokens).
- Warm acquire: with the smallest model resident, `acquire` + `release` of one lease, timed one
  by one over --iterations per repeat (alternating the paths each repeat); median and p99 in µs.
  Paths: the `ResidencyManager` with LRU and with cost-aware eviction (lock, pool, lease object),
  and the bare `ResidencyPool` calls the manager makes (begin_load hit, acquire, release) as the
  floor. ratio = path / bare pool.
- Zipf stream: --requests requests drawn (seeded) over the four models, P(rank k) ∝ k^-s, in two
  popularity orders: smallest model most popular, and largest most popular. The budget is
  --budget-fraction of the four models' total measured bytes, raised if needed to hold the largest
  and the smallest model together (below that, the largest model evicts everything and no policy
  has a choice to make). Each stream is replayed on the pure `ResidencyPool` (no loading) with
  the measured sizes and median reload seconds, exactly as the manager drives it: a miss admits at
  the header estimate, finishes at the measured size, then feeds the reload seconds
  (`set_reload_cost`); every request acquires and releases. Per policy: hits, misses, hit rate,
  evictions, reload_s = sum over misses of the missed model's median reload seconds (what the
  stream pays in loading), and cost / LRU ratios.
- Real replay: the first --real-requests requests of the first stream through real
  `ResidencyManager`s (real loads and evictions) per policy: hits, misses, evictions, measured
  load seconds, and whether hits/misses/evictions equal the pool replay of the same requests
  (cost-aware may differ: it is fed live load times rather than medians).
The last stdout line is one JSON document with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from polylane import catalog
from polylane.policy.residency.pool import RESIDENT, ResidencyPool
from polylane.runtime.loading.converted import converted_path
from polylane.runtime.loading.loader import estimate_weight_bytes, parse_dtype
from polylane.runtime.loading.model_record import resolve_record
from polylane.runtime.residency.manager import ResidencyManager

MODELS = [
    "smollm2-135m-instruct",
    "gemma3-270m",
    "qwen2.5-coder-0.5b-instruct",
    "qwen2.5-coder-1.5b-instruct",
]
POLICIES = ("lru", "cost")
MB = 1e6
FETCH_WAIT_SECONDS = 900


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def source_for(name: str) -> catalog.ModelSource:
    """The model's file, waiting for a fetch another process has in flight rather than racing it."""
    entry = catalog.CATALOG[name]
    target = catalog.cached_path(entry)
    deadline = time.monotonic() + FETCH_WAIT_SECONDS
    while not target.is_file() and time.monotonic() < deadline:
        if not (target.parent.is_dir() and any(target.parent.glob("fetch-*"))):
            break  # nobody is fetching it: resolve() below fetches it
        progress(f"  waiting for another process to finish fetching {name} ...")
        time.sleep(10)
    return catalog.resolve(name, quiet=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ---------------------------------------------------------------------- loads


def bench_loads(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    in_place = args.dtype == "auto"  # the file's blocks in place: nothing converted, ever
    dtype = None if in_place else parse_dtype(args.dtype)
    manager = ResidencyManager(1 << 50)
    loads: dict[str, dict[str, Any]] = {}

    def converted_file(source) -> Path:
        return source.path if dtype is None else converted_path(source.path, dtype)

    for name in MODELS:
        source = source_for(name)
        converted = converted_file(source)
        loads[name] = {
            "gguf_mb": source.path.stat().st_size / MB,
            "first_load": (
                "in place" if in_place else "converted cache" if converted.is_file() else "conversion"
            ),
            "estimate_bytes": estimate_weight_bytes(source.path, source.format, args.dtype),
            "reload_s_all": [],
        }
        manager.register(resolve_record(name, dtype=args.dtype, kv_tokens=args.kv_tokens))

    def load_once(name: str) -> tuple[float, int]:
        with manager.acquire(name):
            pass
        [info] = [info for info in manager.snapshot() if info.name == name]
        manager.evict(name)
        assert info.load_seconds is not None
        return info.load_seconds, info.bytes

    for name in MODELS:
        progress(f"  first load of {name} ({loads[name]['first_load']}) ...")
        seconds, measured = load_once(name)
        source = catalog.resolve(name, quiet=True)
        loads[name].update(
            first_load_s=seconds,
            resident_bytes=measured,
            converted_mb=converted_file(source).stat().st_size / MB,
        )
        progress(f"    {seconds:.2f} s, {measured / MB:.1f} MB resident")
    for repeat in range(args.repeats):  # round-robin, so drift touches every model alike
        for name in MODELS:
            seconds, measured = load_once(name)
            assert measured == loads[name]["resident_bytes"], f"{name}: measured bytes changed"
            loads[name]["reload_s_all"].append(seconds)
        progress(
            f"  reload repeat {repeat + 1}/{args.repeats}: "
            + ", ".join(f"{name} {loads[name]['reload_s_all'][-1]:.2f} s" for name in MODELS)
        )
    manager.close()
    for row in loads.values():
        row["reload_s"] = statistics.median(row["reload_s_all"])
        row["reload_s_best"] = min(row["reload_s_all"])
        row["first_mb_per_s"] = row["gguf_mb"] / row["first_load_s"]
        row["reload_mb_per_s"] = row["converted_mb"] / row["reload_s"]
        row["resident_mb"] = row["resident_bytes"] / MB
    return loads


# ---------------------------------------------------------------------- warm acquire


def bench_warm_acquire(args: argparse.Namespace) -> dict[str, Any]:
    name = MODELS[0]
    managers = {}
    for policy in POLICIES:
        manager = ResidencyManager(1 << 50, eviction=policy)
        for model in MODELS:
            manager.register(resolve_record(model, dtype=args.dtype, kv_tokens=args.kv_tokens))
        with manager.acquire(name):
            pass
        managers[policy] = manager
    pool = ResidencyPool(1 << 50)
    for model in MODELS:
        pool.register(model, 0)
    pool.begin_load(name)
    pool.finish_load(name, 1, handle=name)

    def time_manager(manager: ResidencyManager) -> list[float]:
        samples = []
        clock = time.perf_counter_ns
        for _ in range(args.iterations):
            started = clock()
            lease = manager.acquire(name)
            lease.release()
            samples.append((clock() - started) / 1000)
        return samples

    def time_pool() -> list[float]:
        samples = []
        clock = time.perf_counter_ns
        for _ in range(args.iterations):
            started = clock()
            pool.begin_load(name)
            pool.acquire(name)
            pool.release(name)
            samples.append((clock() - started) / 1000)
        return samples

    timings: dict[str, list[float]] = {"manager_lru": [], "manager_cost": [], "pool": []}
    for repeat in range(args.repeats):
        timings["manager_lru"] += time_manager(managers["lru"])
        timings["manager_cost"] += time_manager(managers["cost"])
        timings["pool"] += time_pool()
        progress(
            f"  warm acquire repeat {repeat + 1}/{args.repeats}: "
            + ", ".join(
                f"{path} {statistics.median(v[-args.iterations :]):.2f} µs" for path, v in timings.items()
            )
        )
    for manager in managers.values():
        manager.close()
    result: dict[str, Any] = {"model": name, "iterations": args.iterations * args.repeats}
    floor = statistics.median(timings["pool"])
    for path, values in timings.items():
        median = statistics.median(values)
        result[path] = {
            "median_us": median,
            "p99_us": percentile(values, 0.99),
            "ratio_to_pool": median / floor,
        }
    return result


# ---------------------------------------------------------------------- Zipf stream


def zipf_stream(order: tuple[str, ...], s: float, requests: int, seed: int) -> list[str]:
    weights = [1 / rank**s for rank in range(1, len(order) + 1)]
    return random.Random(seed).choices(order, weights=weights, k=requests)


def replay_on_pool(
    stream: list[str], policy: str, budget: int, loads: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The stream on the pure policy, driven the way `ResidencyManager.acquire` drives it."""
    pool = ResidencyPool(budget, eviction=policy)
    for name in MODELS:
        pool.register(name, 0)
    reload_seconds = 0.0
    for name in stream:
        if pool.state(name).state == RESIDENT:
            pool.begin_load(name)  # a hit
        else:
            pool.begin_load(name, loads[name]["estimate_bytes"])
            pool.finish_load(name, loads[name]["resident_bytes"], handle=name)
            pool.set_reload_cost(name, loads[name]["reload_s"])
            reload_seconds += loads[name]["reload_s"]
        pool.acquire(name)
        pool.release(name)
        pool.validate()
    counters = pool.counters()
    return {
        "hits": counters.hits,
        "misses": counters.misses,
        "hit_rate": counters.hit_rate,
        "evictions": counters.num_evictions,
        "reload_s": reload_seconds,
    }


def choose_budget(loads: dict[str, dict[str, Any]], fraction: float) -> int:
    sizes = [row["resident_bytes"] for row in loads.values()]
    return max(round(fraction * sum(sizes)), max(sizes) + min(sizes))


def bench_zipf(args: argparse.Namespace, loads: dict[str, dict[str, Any]], budget: int) -> dict[str, Any]:
    by_size = tuple(sorted(MODELS, key=lambda name: loads[name]["resident_bytes"]))
    scenarios = {"smallest most popular": by_size, "largest most popular": by_size[::-1]}
    results: dict[str, Any] = {}
    for label, order in scenarios.items():
        stream = zipf_stream(order, args.zipf_s, args.requests, args.seed)
        runs = {policy: replay_on_pool(stream, policy, budget, loads) for policy in POLICIES}
        results[label] = {
            "popularity": list(order),
            "requests_per_model": {name: stream.count(name) for name in order},
            **runs,
            "cost_vs_lru_reload_s": runs["cost"]["reload_s"] / runs["lru"]["reload_s"],
            "cost_vs_lru_misses": runs["cost"]["misses"] / runs["lru"]["misses"],
        }
    return results


def bench_real_replay(
    args: argparse.Namespace, loads: dict[str, dict[str, Any]], budget: int, order: list[str]
) -> dict[str, Any]:
    stream = zipf_stream(tuple(order), args.zipf_s, args.requests, args.seed)[: args.real_requests]
    results: dict[str, Any] = {"requests": len(stream)}
    for policy in POLICIES:
        manager = ResidencyManager(budget, eviction=policy)
        for name in MODELS:
            manager.register(resolve_record(name, dtype=args.dtype, kv_tokens=args.kv_tokens))
        started = time.perf_counter()
        for name in stream:
            with manager.acquire(name):
                pass
        wall = time.perf_counter() - started
        counters = manager.counters()
        manager.close()
        expected = replay_on_pool(stream, policy, budget, loads)
        real = {
            "hits": counters.pool.hits,
            "misses": counters.pool.misses,
            "evictions": counters.pool.num_evictions,
            "load_s": counters.load_seconds,
            "wall_s": wall,
        }
        same = all(real[key] == expected[key] for key in ("hits", "misses", "evictions"))
        results[policy] = {**real, "pool_replay": expected, "same_as_pool_replay": same}
        progress(
            f"  real replay {policy}: {real['hits']} hits, {real['misses']} misses, "
            f"{real['load_s']:.1f} s loading, same as pool replay: {same}"
        )
    return results


# ---------------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="reloads per model; warm-acquire rounds")
    parser.add_argument("--iterations", type=int, default=20000, help="warm acquires per path per repeat")
    parser.add_argument("--requests", type=int, default=2000, help="requests in each Zipf stream")
    parser.add_argument("--zipf-s", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-fraction", type=float, default=0.5, help="of the models' measured bytes")
    parser.add_argument("--real-requests", type=int, default=40, help="real replay length (0: skip)")
    parser.add_argument("--kv-tokens", type=int, default=4096, help="KV reservation per model, tokens")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated catalogue names")
    args = parser.parse_args()
    MODELS[:] = args.models.split(",")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    progress(f"loads: {args.dtype}, {args.repeats} reloads per model")
    loads = bench_loads(args)
    progress("warm acquire")
    warm = bench_warm_acquire(args)
    budget = choose_budget(loads, args.budget_fraction)
    total = sum(row["resident_bytes"] for row in loads.values())
    progress(f"Zipf streams: budget {budget / MB:.0f} MB of {total / MB:.0f} MB")
    zipf = bench_zipf(args, loads, budget)
    first_order = next(iter(zipf.values()))["popularity"]
    real = bench_real_replay(args, loads, budget, first_order) if args.real_requests else {}

    print(
        f"\n## Loads: {args.dtype}, {args.threads} threads, KV reservation {args.kv_tokens} tokens "
        f"(reload: median of {args.repeats}; best)\n"
    )
    print(
        "| model | GGUF MB | first load | first load s | GGUF MB/s | converted MB | reload s | "
        "reload MB/s | resident MB |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, row in loads.items():
        print(
            f"| {name} | {row['gguf_mb']:.0f} | {row['first_load']} | {row['first_load_s']:.2f} | "
            f"{row['first_mb_per_s']:.0f} | {row['converted_mb']:.0f} | {row['reload_s']:.2f} "
            f"({row['reload_s_best']:.2f}) | {row['reload_mb_per_s']:.0f} | {row['resident_mb']:.0f} |"
        )

    print(f"\n## Warm acquire + release, {warm['model']} resident ({warm['iterations']} per path)\n")
    print("| path | median µs | p99 µs | ratio to bare pool |")
    print("|---|---:|---:|---:|")
    labels = {
        "manager_lru": "ResidencyManager, LRU",
        "manager_cost": "ResidencyManager, cost-aware",
        "pool": "bare ResidencyPool calls",
    }
    for path, label in labels.items():
        row = warm[path]
        print(f"| {label} | {row['median_us']:.2f} | {row['p99_us']:.2f} | {row['ratio_to_pool']:.2f}x |")

    fits = ", ".join(f"{name} {loads[name]['resident_mb']:.0f}" for name in MODELS)
    print(
        f"\n## Zipf stream, s={args.zipf_s}, {args.requests} requests, seed {args.seed}: replayed on "
        "the pure ResidencyPool with the measured sizes and median reload seconds\n"
    )
    print(
        f"Budget {budget / MB:.0f} MB = {budget / total:.2f} of the {len(MODELS)} models' "
        f"{total / MB:.0f} MB (resident MB: {fits}).\n"
    )
    for label, scenario in zipf.items():
        counts = ", ".join(f"{name} {count}" for name, count in scenario["requests_per_model"].items())
        print(f"- {label}: {counts} requests")
    print("\n| popularity | policy | hits | misses | hit rate | evictions | reload s | vs LRU |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, scenario in zipf.items():
        for policy in POLICIES:
            run = scenario[policy]
            ratio = run["reload_s"] / scenario["lru"]["reload_s"]
            name = "LRU" if policy == "lru" else "cost-aware (GDSF)"
            print(
                f"| {label} | {name} | {run['hits']} | {run['misses']} | {run['hit_rate']:.3f} | "
                f"{run['evictions']} | {run['reload_s']:.1f} | {ratio:.2f}x |"
            )

    if real:
        print(
            f"\n## Real replay: the first {real['requests']} requests of the first stream through "
            "ResidencyManager (real loads)\n"
        )
        print(
            "| policy | hits | misses | evictions | load s (measured) | wall s "
            "| pool replay hits/misses/evictions | same |"
        )
        print("|---|---:|---:|---:|---:|---:|---|---|")
        for policy in POLICIES:
            run = real[policy]
            pool = run["pool_replay"]
            print(
                f"| {policy} | {run['hits']} | {run['misses']} | {run['evictions']} | {run['load_s']:.1f} | "
                f"{run['wall_s']:.1f} | {pool['hits']}/{pool['misses']}/{pool['evictions']} | "
                f"{run['same_as_pool_replay']} |"
            )

    load = list(os.getloadavg())
    elapsed = time.perf_counter() - started
    print(f"\nLoad average (1, 5 min) after the run: {load[0]:.2f}, {load[1]:.2f}; total {elapsed:.0f} s\n")
    print(
        json.dumps(
            {
                "dtype": args.dtype,
                "threads": args.threads,
                "repeats": args.repeats,
                "kv_tokens": args.kv_tokens,
                "zipf_s": args.zipf_s,
                "requests": args.requests,
                "seed": args.seed,
                "budget_bytes": budget,
                "total_resident_bytes": total,
                "load_average": load[:2],
                "seconds": elapsed,
                "loads": loads,
                "warm_acquire": warm,
                "zipf": zipf,
                "real_replay": real,
            }
        )
    )


if __name__ == "__main__":
    main()
