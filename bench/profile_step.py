"""Profile one batch-1 decode step of polylane's decoder: where the time goes, op by op.

Run:  python bench/profile_step.py [--model smollm2-135m-instruct] [--dtype fp32|bf16]
      [--context 32] [--steps 10] [--threads 2]

Prints the mean wall time of a decode step (one token, after a prompt of --context tokens, timed
over 40 steps), then torch.profiler's table of --steps steps grouped by op and input shape,
sorted by self CPU time. The last stdout line is one JSON document with the step time.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from polylane.runtime.batch import build_forward_batch
from polylane.runtime.kv_cache import PagedKVCache
from polylane.runtime.loaded_model import load_model
from polylane.types import SequenceChunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, args.dtype, quiet=True)
    block_size, timed = 16, 40
    total = args.context + timed + args.steps + 8
    num_blocks = -(-total // block_size)
    cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype)
    table = tuple(range(num_blocks))
    prompt = tuple(100 + (i * 37) % 1000 for i in range(args.context))
    model.module(build_forward_batch([SequenceChunk(prompt, 0, table)], block_size, model.config), cache)
    length = args.context

    def step() -> None:
        nonlocal length
        chunk = SequenceChunk((5,), length, table)
        model.module(build_forward_batch([chunk], block_size, model.config), cache)
        length += 1

    for _ in range(5):
        step()
    started = time.perf_counter()
    for _ in range(timed):
        step()
    step_ms = (time.perf_counter() - started) / timed * 1000
    print(f"{args.model} {args.dtype}: decode step {step_ms:.1f} ms ({1000 / step_ms:.1f} tokens/s)")
    with torch.profiler.profile(record_shapes=True) as profile:
        for _ in range(args.steps):
            step()
    averages = profile.key_averages(group_by_input_shape=True)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=20))
    print(json.dumps({"model": args.model, "dtype": args.dtype, "context": args.context, "step_ms": step_ms}))


if __name__ == "__main__":
    main()
