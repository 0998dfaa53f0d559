"""The decode kernels alone on synthetic matrices of a GGUF block format: one activation row (the
decode step's kernels) or a batch (decode batches, verify passes), with the memory's plain read
rate measured alongside, so that a kernel change is measured without a model around it.

Run:  python bench/block_kernels.py [--formats q4_k q6_k] [--shapes 151936x1536 1536x8960]
          [--rows 1 8] [--threads 2] [--repeats 5] [--huge]

Builds bench/block_kernels.c (which includes the native block kernels' blocks.c, so it times the
kernels this CPU's build picks) with the stack's compiler flags, then runs each (format, shape,
rows): an N×K matrix of random codes with every scale a small normal half, the tiles shared out
over --threads threads as in a product, the best of --repeats passes; after each pass a plain loop
reads the same bytes on as many threads. Reported: ns per (activation row, 256 columns) per thread,
the weights' GB/s, the plain read's GB/s and the kernel's share of it (the machine's streaming rate
moves between runs; the share moves less). Matrices larger than the L3 (e.g. 151936x1536, Qwen
1.5B's output matrix) wait on memory as a model's do; small ones (1536x1536) time the arithmetic.
--huge asks for 2 MiB pages. Set POLYLANE_NATIVE_MARCH=haswell to time the AVX2 build on a newer
CPU. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from polylane.runtime.model.native import build

HARNESS = Path(__file__).with_name("block_kernels.c")
FORMATS = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q8_0": 8, "q4_k": 12, "q6_k": 14}


def shape(text: str) -> tuple[int, int]:
    rows, _, columns = text.partition("x")
    return int(rows), int(columns)


def run_one(program: Path, fmt: str, n: int, k: int, rows: int, args: argparse.Namespace) -> dict:
    """One (format, shape, rows) run of the harness: its JSON line."""
    command = [str(program), str(FORMATS[fmt]), str(n), str(k), str(rows)]
    command += [str(args.threads), str(args.repeats), "1" if args.huge else "0"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(done.stderr.strip() or f"block_kernels exited with {done.returncode}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", choices=sorted(FORMATS), default=["q4_k", "q6_k"])
    parser.add_argument("--shapes", type=shape, nargs="+", default=[(151936, 1536), (1536, 8960)])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--huge", action="store_true", help="2 MiB pages for the matrix (MADV_HUGEPAGE)")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        program = Path(folder) / "block_kernels"
        try:
            build.build_program(HARNESS, program)
        except RuntimeError as error:
            raise SystemExit(str(error)) from error
        print("| format | matrix | rows | ns per (row, 256 cols), thread | GB/s | plain read GB/s | share |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for fmt in args.formats:
            for n, k in args.shapes:
                for rows in args.rows:
                    result = results[f"{fmt} {n}x{k} rows {rows}"] = run_one(program, fmt, n, k, rows, args)
                    cells = [fmt, f"{n}×{k}", str(rows), f"{result['ns_per_row_256']:.3f}"]
                    rates = ("weights_gb_per_s", "plain_read_gb_per_s", "of_plain_read")
                    cells += [f"{result[key]:.2f}" for key in rates]
                    print("| " + " | ".join(cells) + " |")
    print(json.dumps({"threads": args.threads, "huge_pages": args.huge, "results": results}))


if __name__ == "__main__":
    main()
