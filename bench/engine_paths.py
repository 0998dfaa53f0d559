"""The engine's own prefill and decode speed for one model, one request at a time.

Run:  python bench/engine_paths.py [--model smollm2-135m-instruct] [--dtype fp32|bf16|int8|int4]

Through `Engine` (the engine thread, its loader, the residency manager: everything a served
request goes through, without HTTP): prefill = TTFT of three 512-token prompts (one output token),
decode = tokens/s after the first token of two 64-token greedy requests (EOS ignored). Compare with
`bench/profile_step.py`, which times the bare forward: a gap between the two is engine overhead
(this script found the loader-thread and mmap-threshold slowdowns of docs/profile.md). Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics

from polylane.engine import Engine, EngineConfig
from polylane.types import WEIGHT_DTYPES, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="fp32", choices=WEIGHT_DTYPES)
    args = parser.parse_args()
    text = " ".join(
        f"Note {i}: the shipment left dock {i % 7} at {i % 24}:00 with {i * 13 % 90} crates."
        for i in range(200)
    )
    with Engine(EngineConfig(budget_bytes=8 << 30)) as engine:
        engine.add_model(args.model, dtype=args.dtype, kv_tokens=4096)
        engine.generate(args.model, "warm up", SamplingParams(max_tokens=4))
        tokenizer = engine.models[args.model].tokenizer
        prefill = []
        for index in range(3):
            ids = tokenizer.encode(f"[{index}] {text}")[:512]
            done = engine.submit(args.model, ids, params=SamplingParams(max_tokens=1)).result()
            prefill.append(len(ids) / done.ttft_seconds)
        decode = []
        for index in range(2):
            params = SamplingParams(max_tokens=64, ignore_eos=True)
            done = engine.submit(
                args.model, f"[{index}] Write a short story about a robot.", params=params
            ).result()
            decode.append(1 / done.tpot_seconds)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "prefill_tokens_per_s": statistics.median(prefill),
        "decode_tokens_per_s": statistics.median(decode),
    }
    print(
        f"{args.model} {args.dtype}: prefill {result['prefill_tokens_per_s']:.0f} tok/s (512 tokens), "
        f"decode {result['decode_tokens_per_s']:.1f} tok/s (one stream)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
