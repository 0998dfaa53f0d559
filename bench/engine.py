"""Engine benchmark: one decode lane over three resident models against its two baselines.

Run:  python bench/engine.py [--streams 8] [--max-tokens 64] [--dtype fp32|bf16] [--repeats 3]
      [--policy throughput] [--quantum 4]

Three ways to serve the same 8 concurrent greedy streams (prompts from a fixed list, EOS ignored
so every stream produces exactly --max-tokens tokens), alternating in each repeat so machine
drift cancels:
- polylane: one process, one `Engine`, the three small models resident (warmed up before the
  clock starts), streams spread round-robin over SmolLM2, Gemma 3 and Qwen 0.5B; one model owns
  the decode lane per step and batches all of its streams.
- one-model: the same engine and streams, every stream on SmolLM2 (the lane never switches).
- per-process: one polylane process per model (three at once, each loaded before a shared start
  signal), each serving its share of the streams, the way one-process-per-model servers
  (Ollama, llama.cpp, vLLM) are deployed today.

Metrics:
- throughput: all generated tokens / wall seconds from the first submit to the last token.
- tpot p50/p99: per stream, (last token time − first token time) / (tokens − 1), over all streams.
- ttft p50: seconds from submit to a stream's first token.
- switch_overhead (polylane): switches × (seconds per token of switch steps − of other decode
  steps) / decode seconds, from the engine's stats; lane_share: decode steps per model.
- ratio: polylane throughput / baseline throughput (> 1: polylane is faster).
The last stdout line is one JSON document with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from polylane.engine import Engine, EngineConfig
from polylane.engine_stats import percentile
from polylane.policy.scheduling.scheduler import SchedulerConfig
from polylane.types import SamplingParams

MODELS = ("smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct")
PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    'def quicksort(items):\n    """Sort a list of numbers."""\n',
    "Summarise the causes of the French Revolution in three sentences.",
    "Extract the dates from: The meeting moved from 3 March to 14 April 2021, then to May.",
    "Explain how a hash map handles collisions.",
    "SELECT customer_id, SUM(total) FROM orders",
    "List five facts about the planet Mars.",
    "Translate to French: The weather is lovely today and we are going to the beach.",
)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_engine(models: tuple[str, ...], args: argparse.Namespace) -> Engine:
    config = EngineConfig(
        budget_bytes=64 * 2**30,
        scheduler=SchedulerConfig(lane_policy=args.policy, quantum=args.quantum),
    )
    engine = Engine(config)
    for name in models:
        engine.add_model(name, dtype=args.dtype, kv_tokens=1024)
        engine.generate(name, "Hello", SamplingParams(max_tokens=2))  # load and warm up
    return engine


def run_streams(engine: Engine, assignment: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Submit every stream at once; per-stream token timings and the wall time."""
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    started = time.time()
    handles = [
        engine.submit(model, PROMPTS[i % len(PROMPTS)], params=params) for i, model in enumerate(assignment)
    ]
    results = [h.result(timeout=1800) for h in handles]
    ended = time.time()
    return {
        "started": started,
        "ended": ended,
        "tokens": sum(len(r.token_ids) for r in results),
        "tpot": [r.tpot_seconds for r in results if r.tpot_seconds is not None],
        "ttft": [r.ttft_seconds for r in results if r.ttft_seconds is not None],
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    started = min(r["started"] for r in runs)
    ended = max(r["ended"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    tpot = [t for r in runs for t in r["tpot"]]
    ttft = [t for r in runs for t in r["ttft"]]
    return {
        "tokens": tokens,
        "seconds": ended - started,
        "throughput": tokens / (ended - started),
        "tpot_p50_ms": 1000 * percentile(tpot, 50),
        "tpot_p99_ms": 1000 * percentile(tpot, 99),
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
    }


def bench_engine(engine: Engine, assignment: list[str], args: argparse.Namespace) -> dict[str, Any]:
    before = engine.stats()
    summary = summarise([run_streams(engine, assignment, args)])
    after = engine.stats()
    switches = after.switches - before.switches
    decode_steps = after.decode_steps - before.decode_steps
    lane = {
        name: (
            after.models[name].lane_steps - (before.models[name].lane_steps if name in before.models else 0)
        )
        / max(1, decode_steps)
        for name in after.models
    }
    summary.update(
        switches=switches,
        decode_steps=decode_steps,
        lane_share={k: round(v, 3) for k, v in lane.items() if v},
        switch_overhead=after.switch_overhead,
        max_concurrent_decode=after.max_concurrent_decode,
    )
    return summary


def bench_per_process(args: argparse.Namespace) -> dict[str, Any]:
    """One process per model, each with its share of the streams, started by one signal."""
    shares = {name: 0 for name in MODELS}
    for i in range(args.streams):
        shares[MODELS[i % len(MODELS)]] += 1
    workers = []
    for name, count in shares.items():
        command = [sys.executable, __file__, "--worker", name, "--streams", str(count)]
        command += ["--max-tokens", str(args.max_tokens), "--dtype", args.dtype]
        workers.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for worker in workers:
        assert worker.stdout is not None
        line = worker.stdout.readline()
        if line.strip() != "ready":
            raise SystemExit(f"a per-process worker failed to start: {line!r}")
    for worker in workers:
        assert worker.stdin is not None
        worker.stdin.write("go\n")
        worker.stdin.flush()
    runs = []
    for worker in workers:
        out, _ = worker.communicate(timeout=1800)
        runs.append(json.loads(out.strip().splitlines()[-1]))
    return summarise(runs)


def worker_main(args: argparse.Namespace) -> None:
    engine = make_engine((args.worker,), args)
    print("ready", flush=True)
    sys.stdin.readline()
    run = run_streams(engine, [args.worker] * args.streams, args)
    engine.close()
    print(json.dumps(run), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policy", default="throughput")
    parser.add_argument("--quantum", type=int, default=4)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return

    progress("loading the three models into one engine …")
    engine = make_engine(MODELS, args)
    spread = [MODELS[i % len(MODELS)] for i in range(args.streams)]
    one_model = [MODELS[0]] * args.streams
    results: dict[str, list[dict[str, Any]]] = {"polylane": [], "one-model": [], "per-process": []}
    for repeat in range(args.repeats):
        order = ["polylane", "one-model", "per-process"]
        if repeat % 2:
            order.reverse()
        for system in order:
            progress(f"repeat {repeat + 1}/{args.repeats}: {system}")
            if system == "polylane":
                results[system].append(bench_engine(engine, spread, args))
            elif system == "one-model":
                results[system].append(bench_engine(engine, one_model, args))
            else:
                results[system].append(bench_per_process(args))
    engine.close()

    def median(system: str, key: str) -> float:
        return statistics.median(r[key] for r in results[system])

    print(
        f"\n{args.streams} concurrent greedy streams × {args.max_tokens} tokens, {args.dtype}, "
        f"policy {args.policy} (quantum {args.quantum}), median of {args.repeats} alternating repeats, "
        f"{os.cpu_count()} cores\n"
    )
    print("| system | tokens/s | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms | polylane ÷ system |")
    print("|---|---|---|---|---|---|")
    poly = median("polylane", "throughput")
    for system in results:
        tput = median(system, "throughput")
        print(
            f"| {system} | {tput:.1f} | {median(system, 'tpot_p50_ms'):.1f} | "
            f"{median(system, 'tpot_p99_ms'):.1f} | {median(system, 'ttft_p50_ms'):.0f} | "
            f"{poly / tput:.2f}x |"
        )
    last = results["polylane"][-1]
    print(
        f"\npolylane lane: switches {last['switches']} over {last['decode_steps']} decode steps, "
        f"switch overhead {100 * last['switch_overhead']:.1f}% of lane time, "
        f"lane share {last['lane_share']}, "
        f"max concurrent decode {last['max_concurrent_decode']}"
    )
    load = os.getloadavg()
    print(f"Load average (1, 5 min) after the run: {load[0]:.2f}, {load[1]:.2f}\n")
    summary = {
        system: {
            key: median(system, key) for key in ("throughput", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms")
        }
        for system in results
    }
    print(
        json.dumps(
            {
                "streams": args.streams,
                "max_tokens": args.max_tokens,
                "dtype": args.dtype,
                "policy": args.policy,
                "quantum": args.quantum,
                "repeats": args.repeats,
                "summary": summary,
                "ratio_vs_one_model": poly / summary["one-model"]["throughput"],
                "ratio_vs_per_process": poly / summary["per-process"]["throughput"],
                "runs": results,
                "load_average": list(load[:2]),
            }
        )
    )


if __name__ == "__main__":
    main()
