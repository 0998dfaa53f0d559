"""A GGUF model's block products by the number of activation rows: where decode, batches, verify
passes and prompts spend their time in the kernels.

Run:  python bench/block_rows.py [--model smollm2-135m-instruct] [--rows 1 8 16 64] [--repeats 8]

Loads the model at dtype auto (the file's blocks in place, 8-bit activations) and times each kind
of projection (the fused QKV, the attention output, the fused gate/up, the MLP's down, the output
matrix) on random activations of each row count: one call per layer's matrix, the best of
--repeats passes over all layers, reported per matrix and per activation row (µs). Which kernel
runs follows from the row count (`runtime/model/native/blocks_q8.c`: one row and up to DECODE_ROWS_BELOW
rows take the decode kernels, more the coded path). Set POLYLANE_NATIVE_MARCH=haswell to time the
AVX2 build on a newer CPU. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from polylane.runtime.loading.loaded_model import load_model
from polylane.runtime.model.block_weights import BlockProjection, isa_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    model = load_model(args.model, "auto", quiet=True)
    kinds: dict[str, list[BlockProjection]] = {}
    for name, module in model.module.named_modules():
        if isinstance(module, BlockProjection):
            kinds.setdefault(name.split(".")[-1] if "layers." in name else name, []).append(module)
    results: dict[str, dict[str, float]] = {}
    for kind, projections in kinds.items():
        first = projections[0]
        results[kind] = {}
        for rows in args.rows:
            x = torch.randn(rows, first.in_features, generator=torch.Generator().manual_seed(rows))
            for projection in projections[:3]:  # warm-up
                projection(x)
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                for projection in projections:
                    projection(x)
                best = min(best, (time.perf_counter() - started) / len(projections))
            results[kind][str(rows)] = best * 1e6
    threads = torch.get_num_threads()
    print(f"{args.model} auto, {isa_name()} block kernels, {threads} threads: µs per matrix (per row)")
    print("| matrix | shape, formats | " + " | ".join(f"{rows} rows" for rows in args.rows) + " |")
    print("|---|---|" + "---:|" * len(args.rows))
    for kind, projections in kinds.items():
        first = projections[0]
        shape = f"{first.out_features}×{first.in_features} {'+'.join(sorted(set(first.formats)))}"
        cells = [
            f"{results[kind][str(rows)]:.0f} ({results[kind][str(rows)] / rows:.1f})" for rows in args.rows
        ]
        print(f"| {kind} | {shape} | " + " | ".join(cells) + " |")
    print(json.dumps({"model": args.model, "isa": isa_name(), "us_per_matrix": results}))


if __name__ == "__main__":
    main()
