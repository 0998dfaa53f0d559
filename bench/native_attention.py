"""The native stack's attention alone, over a model's heads: ns per (token, key, layer) for one-token steps
and batches, so that a change to the attention is measured without the products around it.

Run:  python bench/native_attention.py [--model smollm2-135m-instruct] [--tokens 1 8]
          [--context 512 1024] [--repeats 8] [--threads 2]

Builds bench/native_attention.c (which includes the native stack's decoder.c, so it times the
`attention_impl` this CPU's build picks) with the stack's compiler flags, then runs it on one bf16
cache per layer of the model's shape (query heads, KV heads, head size, layers: read from its
file's header; the caches hold tokens × context keys, so a pass reads from memory as a decode step
does). Set POLYLANE_NATIVE_MARCH=haswell to time the AVX2 build on a newer CPU. Prints a table
and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from polylane import catalog
from polylane.runtime.loading.loader import read_config
from polylane.runtime.model.native import build

HARNESS = Path(__file__).with_name("native_attention.c")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    source = catalog.resolve(args.model)
    config = read_config(source.path, source.format)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        program = Path(folder) / "native_attention"
        try:
            build.build_program(HARNESS, program)
        except RuntimeError as error:
            raise SystemExit(str(error)) from error
        for tokens in args.tokens:
            for context in args.context:
                shape = (config.num_heads, config.num_kv_heads, config.head_dim, config.num_layers)
                command = [
                    str(program),
                    *map(str, shape),
                    str(tokens),
                    str(context),
                    str(args.repeats),
                    str(args.threads),
                ]
                line = (
                    subprocess.run(command, check=True, capture_output=True, text=True)
                    .stdout.strip()
                    .splitlines()[-1]
                )
                results[f"{tokens}x{context}"] = json.loads(line)
    heads = f"{config.num_heads} query heads, {config.num_kv_heads} KV heads"
    print(f"{args.model}: {heads}, {config.head_dim} dims, {config.num_layers} layers")
    print("| tokens × keys | ns per (token, key, layer) | cache read GB/s | ms per pass |")
    print("|---|---:|---:|---:|")
    for key, value in results.items():
        cells = (
            f"{value['ns_per_token_key']:.1f}",
            f"{value['gb_per_s']:.1f}",
            f"{value['ms_per_pass']:.2f}",
        )
        print(f"| {key} | " + " | ".join(cells) + " |")
    print(json.dumps({"model": args.model, "results": results}))


if __name__ == "__main__":
    main()
