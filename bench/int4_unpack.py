"""How fast torch's packed int4 weights unpack to codes: a transpose (a known interleave) against a
row gather (any other row order), per weight shape.

Run:  python bench/int4_unpack.py [--shapes 3072x576 17920x1536] [--repeats 5]

`runtime/model/int4_layout.py` reads the layout this torch packs in; a layout whose rows are interleaved
(AVX512's and AVX2's low/high nibbles, DEFAULT's rows in order) unpacks by a view and a permute, any
other order by gathering rows. Both are checked to give the packed codes; the table gives ms per
unpack of the whole weight (the torch path does this per prompt forward of 128+ tokens). The last
line of stdout is one JSON document.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from polylane.runtime.model.int4_layout import packing_layout


def milliseconds(run, repeats: int) -> float:
    run()
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["3072x576", "17920x1536"], help="N x K")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    layout = packing_layout()
    if layout is None:
        raise SystemExit("torch's int4 packing is of an unknown kind here")
    # the same layout read by gathering rows (as a row order without an interleave would be)
    gathering = dataclasses.replace(layout)
    gathering.__dict__["interleave"] = None
    print(f"layout: {layout.name}, interleave {layout.interleave}, torch {torch.__version__}")
    print("| N × K | transpose ms | gather ms | gather ÷ transpose |\n|---|---:|---:|---:|")
    rows = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        for reader in (layout, gathering):
            assert torch.equal(reader.unpack(packed, k, 0, n).int(), codes)
        fast = milliseconds(lambda: layout.unpack(packed, k, 0, n), args.repeats)  # noqa: B023
        slow = milliseconds(lambda: gathering.unpack(packed, k, 0, n), args.repeats)  # noqa: B023
        print(f"| {n} × {k} | {fast:.2f} | {slow:.2f} | {slow / fast:.1f}× |")
        rows.append({"n": n, "k": k, "transpose_ms": fast, "gather_ms": slow})
    print(json.dumps({"layout": layout.name, "threads": torch.get_num_threads(), "shapes": rows}))


if __name__ == "__main__":
    main()
