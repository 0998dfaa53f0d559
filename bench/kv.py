"""KV reuse benchmark: prefix-cache TTFT and one-pass tree verify, against their plain baselines.

Run:  python bench/kv.py [--model smollm2-135m-instruct] [--dtype fp32|bf16] [--threads 2]
      [--repeats 5]

Metrics (each run alternates the measured system with its baseline, so machine drift cancels;
tables show the median over --repeats and the best):
- ttft_cold_ms: time to the first token of a 1,000-token prompt on a model with no prefix cache
  (one chunked prefill of all 1,000 tokens, then the first token).
- ttft_warm_ms: the same prompt when its first 900 tokens are in the prefix tree (a 900-token
  request ran first on a fresh `ModelKV` and completed); only the rest is prefilled.
  cached_tokens says how many prompt tokens came from the cache. ttft_speedup = cold / warm.
- sequential_ms: 16 single-token decode steps, one forward each, after a 64-token prompt.
- tree_verify_ms: one forward over a 16-node token tree (logits for every node) at the same point,
  then dropping it (`accept` of an empty path).
- chain_verify_ms: one forward over a 16-token chain (logits for every token), then a rollback.
- tree_speedup = sequential / tree verify; chain_speedup = sequential / chain verify.
Checks printed with the numbers: the first token is the same warm and cold.
The last stdout line is one JSON document with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from polylane.runtime.generate import GenerationRequest, Generator
from polylane.runtime.kv.model_kv import Extend, ModelKV
from polylane.runtime.loading.loaded_model import load_model
from polylane.types import SamplingParams

PROMPT_TOKENS = 1000
CACHED_TOKENS = 900
TREE_PARENTS = (-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6)  # 16 nodes, 4 levels


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def long_prompt(model: Any, variant: int) -> tuple[int, ...]:
    """1,000 tokens: a fixed 900-token head and a tail that differs per `variant`."""
    topics = ["rivers", "bridges", "violins", "glaciers", "printing", "orbits", "bees", "tides"]
    head_text = " ".join(
        f"Note {i}: the {topics[i % len(topics)]} chapter lists {i * 7 % 53} facts about them."
        for i in range(200)
    )
    head = tuple(model.tokenizer.encode(head_text))[:CACHED_TOKENS]
    tail_text = " ".join(
        f"Variant {variant}, question {i}: what changed in year {1900 + i}?" for i in range(40)
    )
    tail = tuple(model.tokenizer.encode(tail_text))[: PROMPT_TOKENS - CACHED_TOKENS]
    assert len(head) == CACHED_TOKENS and len(tail) == PROMPT_TOKENS - CACHED_TOKENS
    return head + tail


def first_token(generator: Generator, prompt: tuple[int, ...]) -> tuple[int, float, int]:
    request = GenerationRequest(prompt, SamplingParams(max_tokens=1), stop_at_eos=False)
    [output] = generator.generate([request])
    return output.token_ids[0], output.ttft_seconds, output.cached_tokens


def bench_ttft(model: Any, repeats: int) -> dict[str, Any]:
    blocks = 2 * PROMPT_TOKENS // 16 + 8
    warm_ms, cold_ms, cached, same_token = [], [], [], True
    for repeat in range(repeats):
        prompt = long_prompt(model, repeat)
        kv = ModelKV(model, num_blocks=blocks, block_size=16, prefix_cache=True)
        warm = Generator(model, kv=kv)
        first_token(warm, prompt[:CACHED_TOKENS])  # completes, so its KV enters the tree
        token_warm, seconds, hit = first_token(warm, prompt)
        warm_ms.append(seconds * 1000)
        cached.append(hit)
        if hit < CACHED_TOKENS - 16:
            raise SystemExit(
                f"prefix cache served only {hit} of {CACHED_TOKENS} tokens; the benchmark is void"
            )
        cold = Generator(model, num_blocks=blocks, block_size=16, prefix_cache=False)
        token_cold, seconds, _ = first_token(cold, prompt)
        cold_ms.append(seconds * 1000)
        same_token &= token_warm == token_cold
        progress(
            f"  ttft repeat {repeat + 1}/{repeats}: warm {warm_ms[-1]:.1f} ms ({hit} cached), "
            f"cold {cold_ms[-1]:.1f} ms"
        )
    return {
        "ttft_warm_ms": statistics.median(warm_ms),
        "ttft_cold_ms": statistics.median(cold_ms),
        "ttft_warm_ms_best": min(warm_ms),
        "ttft_cold_ms_best": min(cold_ms),
        "ttft_speedup": statistics.median(cold_ms) / statistics.median(warm_ms),
        "cached_tokens": min(cached),
        "first_token_same_warm_and_cold": same_token,
    }


def bench_verify(model: Any, repeats: int) -> dict[str, Any]:
    words = " ".join(f"word{i}" for i in range(200))
    prompt = tuple(model.tokenizer.encode(words))[:64]
    kv = ModelKV(model, num_blocks=64, block_size=16, prefix_cache=False)
    sequence = kv.open(prompt)
    logits = kv.forward([Extend(sequence, prompt)])[0]
    candidates = tuple(int(t) for t in logits.topk(16).indices)
    size = len(TREE_PARENTS)
    timings: dict[str, list[float]] = {"sequential": [], "tree": [], "chain": []}

    def sequential() -> None:
        token = candidates[0]
        for _ in range(size):
            token = int(kv.forward([Extend(sequence, (token,))])[0].argmax())
        kv.rollback(sequence, len(prompt))

    def tree() -> None:
        kv.forward([Extend(sequence, candidates, tree_parents=TREE_PARENTS, logits="all")])
        kv.accept(sequence, [])

    def chain() -> None:
        kv.forward([Extend(sequence, candidates, logits="all")])
        kv.rollback(sequence, len(prompt))

    runs = {"sequential": sequential, "tree": tree, "chain": chain}
    for run in runs.values():  # warm-up
        run()
    for repeat in range(repeats):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            timings[name].append((time.perf_counter() - started) * 1000)
        progress(
            f"  verify repeat {repeat + 1}/{repeats}: "
            + ", ".join(f"{name} {values[-1]:.1f} ms" for name, values in timings.items())
        )
    kv.close(sequence, cache=False)
    median = {name: statistics.median(values) for name, values in timings.items()}
    return {
        "sequential_ms": median["sequential"],
        "tree_verify_ms": median["tree"],
        "chain_verify_ms": median["chain"],
        "sequential_ms_best": min(timings["sequential"]),
        "tree_verify_ms_best": min(timings["tree"]),
        "chain_verify_ms_best": min(timings["chain"]),
        "tree_speedup": median["sequential"] / median["tree"],
        "chain_speedup": median["sequential"] / median["chain"],
        "nodes": size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, args.dtype, quiet=True)
    progress(f"{model.name} {args.dtype}, {args.threads} threads, {args.repeats} repeats")
    ttft = bench_ttft(model, args.repeats)
    verify = bench_verify(model, args.repeats)
    print(f"\n## {model.name}, {args.dtype}, {args.threads} threads (median of {args.repeats}; best)\n")
    print("| metric | polylane | baseline | ratio |")
    print("|---|---:|---:|---:|")
    print(
        f"| TTFT, {PROMPT_TOKENS}-token prompt, {ttft['cached_tokens']} cached vs cold (ms) | "
        f"{ttft['ttft_warm_ms']:.1f} ({ttft['ttft_warm_ms_best']:.1f}) | "
        f"{ttft['ttft_cold_ms']:.1f} ({ttft['ttft_cold_ms_best']:.1f}) | {ttft['ttft_speedup']:.2f}x |"
    )
    for kind in ("tree", "chain"):
        print(
            f"| one {kind} verify of 16 tokens vs 16 decode steps (ms) | "
            f"{verify[f'{kind}_verify_ms']:.1f} ({verify[f'{kind}_verify_ms_best']:.1f}) | "
            f"{verify['sequential_ms']:.1f} ({verify['sequential_ms_best']:.1f}) | "
            f"{verify[f'{kind}_speedup']:.2f}x |"
        )
    print(f"\nFirst token identical warm and cold: {ttft['first_token_same_warm_and_cold']}\n")
    load = list(os.getloadavg())
    print(f"Load average (1, 5 min) after the run: {load[0]:.2f}, {load[1]:.2f}\n")
    print(
        json.dumps(
            {
                "model": model.name,
                "dtype": args.dtype,
                "threads": args.threads,
                "repeats": args.repeats,
                "load_average": load[:2],
                **ttft,
                **verify,
            }
        )
    )


if __name__ == "__main__":
    main()
