"""int8 projections at many rows: torch's int8 kernel against a bf16 GEMM of the codes, side by side.

Run:  python bench/int8_gemm.py [--rows 8 16 32 64 512] [--threads 2] [--repeats 10]

For SmolLM2's three projection shapes (fused gate/up 3,072 × 576, down 576 × 1,536, fused QKV
960 × 576), times one call of `aten._weight_int8pack_mm` (bf16 activations, int8 codes, bf16 row
scales) and of the torch path's replacement from `quantize.INT8_GEMM_MIN_ROWS` rows on: the codes
cast to bf16 (exact), a dense GEMM, the row scales after. Each time is the median of --repeats
calls after three warm-up calls; `max diff` is the largest difference between the two results
(bf16 outputs, so a few units in the last place of the largest value). Prints a table and, last,
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from polylane.runtime.model.layers import linear

SHAPES = {"gate/up": (3072, 576), "down": (576, 1536), "qkv": (960, 576)}


def median_ms(call: Callable[[], torch.Tensor], repeats: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    results = []
    print("| projection | rows | int8 kernel (ms) | bf16 GEMM of the codes (ms) | kernel ÷ GEMM | max diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (out_features, in_features) in SHAPES.items():
        codes = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
        scales = (torch.rand(out_features, generator=generator) * 0.01).to(torch.bfloat16)
        for rows in args.rows:
            x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)

            def kernel(x=x, codes=codes, scales=scales) -> torch.Tensor:
                return torch.ops.aten._weight_int8pack_mm(x, codes, scales)

            def gemm(x=x, codes=codes, scales=scales) -> torch.Tensor:
                return linear(x, codes.to(torch.bfloat16), None, input_major=False) * scales

            difference = (kernel().float() - gemm().float()).abs().max().item()
            kernel_ms, gemm_ms = median_ms(kernel, args.repeats), median_ms(gemm, args.repeats)
            ratio = kernel_ms / gemm_ms
            print(f"| {name} | {rows} | {kernel_ms:.2f} | {gemm_ms:.2f} | {ratio:.2f}× | {difference:.3g} |")
            results.append(
                {"projection": name, "rows": rows, "kernel_ms": kernel_ms, "gemm_ms": gemm_ms}
                | {"max_diff": difference}
            )
    print(json.dumps({"threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
