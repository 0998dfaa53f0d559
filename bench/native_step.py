"""One forward step, native stack against the torch path, side by side in one run.

Run:  python bench/native_step.py [--model smollm2-135m-instruct] [--dtype int4|auto|...]
      [--batch 1 8] [--context 64 400] [--threads 2] [--steps 40] [--prefill 127 383]
      [--prompts 1] [--native-only]

Loads the model and times the bare forward (no engine) of a decode step — --batch sequences, one
new token each, after --context tokens — median of --steps steps, for: the native stack with its
AMX kernel (where the CPU has AMX), with its AVX512-BF16 kernel (a GGUF file's blocks, dtype auto:
the native stack as built here, "native"), and the torch path
(`module.native_stack` set aside), all on the same KV cache. Also a prefill forward of --prefill
tokens (127 and 383) where the native stack takes that many: --prompts sequences of that many
tokens each in one forward (tokens/s counts them all). Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from polylane.runtime.kv.kv_cache import PagedKVCache
from polylane.runtime.loading.loaded_model import load_model
from polylane.runtime.model.batch import build_forward_batch
from polylane.runtime.model.native import stack as native
from polylane.types import WEIGHT_DTYPES, SequenceChunk

BLOCK = 16


def time_step(module, cache, chunks, steps: int) -> float:
    batch = build_forward_batch(chunks, BLOCK, module.config)
    for _ in range(3):
        module(batch, cache)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        module(batch, cache)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="int4", choices=WEIGHT_DTYPES)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, nargs="+", default=[64, 400])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prefill", type=int, nargs="*", default=[127, 383], help="prompt sizes to time")
    parser.add_argument("--prompts", type=int, default=1, help="prompts of --prefill tokens in one forward")
    parser.add_argument("--native-only", action="store_true", help="the native stack alone (for a profiler)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, args.dtype, quiet=True, device="cpu")  # the CPU stacks compared
    module, lib = model.module, native.library()
    stack = module.native_stack
    if stack is None or lib is None:
        raise SystemExit(f"the native stack does not run this model here: {model.compute_path}")
    kernel = native.kernel_name()
    kernels = ["amx", "avx512-bf16"] if kernel == "amx" else [kernel or "native"]
    systems = kernels if args.native_only else [*kernels, "torch"]

    def run(system: str, measure, *arguments):
        lib.polylane_use_amx(int(system == "amx"))
        module.native_stack = None if system == "torch" else stack
        try:
            return measure(*arguments)
        finally:
            module.native_stack = stack
            lib.polylane_use_amx(1)

    results: dict[str, dict[str, float]] = {system: {} for system in systems}
    longest = max(args.context) + 1
    per_sequence = -(-longest // BLOCK)
    for batch_size in args.batch:
        tables = [tuple(range(s * per_sequence, (s + 1) * per_sequence)) for s in range(batch_size)]
        cache = PagedKVCache(module.config, per_sequence * batch_size, BLOCK, model.kv_dtype)
        for context in args.context:
            prompt = tuple(100 + i % 1000 for i in range(context))
            for table in tables:  # each sequence's context written by the torch path's prefill
                batch = build_forward_batch([SequenceChunk(prompt, 0, table)], BLOCK, module.config)
                run("torch", module, batch, cache)
            chunks = [SequenceChunk((42,), context, table) for table in tables]
            for system in systems:
                seconds = run(system, time_step, module, cache, chunks, args.steps)
                results[system][f"decode_b{batch_size}_c{context}_ms"] = seconds * 1e3
    for tokens in [n for n in args.prefill if n * args.prompts < stack.max_tokens]:
        blocks = -(-tokens // BLOCK)
        cache = PagedKVCache(module.config, blocks * args.prompts, BLOCK, model.kv_dtype)
        tables = [tuple(range(p * blocks, (p + 1) * blocks)) for p in range(args.prompts)]
        prompts = [tuple(100 + 7 * p + i for i in range(tokens)) for p in range(args.prompts)]
        chunks = [SequenceChunk(prompt, 0, table) for prompt, table in zip(prompts, tables, strict=True)]
        size = f"{tokens}" if args.prompts == 1 else f"{args.prompts}x{tokens}"
        name = f"prefill_{size}_tokens_per_s"
        for system in systems:
            seconds = run(system, time_step, module, cache, chunks, 3)
            results[system][name] = tokens * args.prompts / seconds

    keys = list(results[systems[0]])
    print(f"{args.model} {args.dtype}, {args.threads} threads: decode step (ms) and prefill (tokens/s)")
    ratios = len(systems) > 1
    print("| " + " | ".join(["measure", *systems, *([f"{systems[0]} speedup"] if ratios else [])]) + " |")
    print("|---" * (len(systems) + 1 + ratios) + "|")
    for key in keys:
        values = [results[s][key] for s in systems]
        ratio = values[-1] / values[0] if key.startswith("decode") else values[0] / values[-1]
        shown = [key, *(f"{v:.2f}" for v in values), *([f"{ratio:.2f}×"] if ratios else [])]
        print("| " + " | ".join(shown) + " |")
    print(json.dumps({"model": args.model, "dtype": args.dtype, "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
