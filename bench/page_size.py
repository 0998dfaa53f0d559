"""A decode step over a GGUF file mapped with 4 KiB pages against the same file mapped with 2 MiB
pages, side by side in one run.

Run:  python bench/page_size.py [--model qwen2.5-coder-1.5b-instruct] [--context 64] [--steps 30]
      [--rounds 3] [--drop-cache]

The model loads at dtype auto (the file's blocks in place). Two more read-only mappings of the same
file are made: one advised MADV_NOHUGEPAGE (every weight read through 4 KiB page table entries),
one advised MADV_HUGEPAGE (2 MiB entries where the page cache holds the file in 2 MiB folios), and
the model's weight pointers are switched between them. Each round times --steps decode steps
(batch 1, one new token after --context tokens, the native stack where it runs) on each mapping,
alternating which goes first; reported: the median step in ms per round and the best round's, and
how much of each mapping the kernel mapped with 2 MiB pages (/proc/self/smaps `FilePmdMapped`).
The page cache keeps the folio size a file was first read with: --drop-cache drops the file from
it first (it is then read from disk through the 2 MiB mapping), for a file cached in 4 KiB folios.
The last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import time

import numpy as np

from polylane.catalog import resolve
from polylane.runtime.batch import build_forward_batch
from polylane.runtime.block_weights import BlockProjection
from polylane.runtime.kv_cache import PagedKVCache
from polylane.runtime.loaded_model import load_model
from polylane.types import SequenceChunk

BLOCK = 16


def mapping(path: str, advice: int) -> tuple[mmap.mmap, int]:
    with open(path, "rb") as handle:
        view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    view.madvise(advice)
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    return view, address


def file_base(path: str) -> int:
    """The address the model's own mapping of `path` starts at (offset 0), from /proc/self/maps."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == real and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16)
    raise SystemExit(f"the model's mapping of {real} was not found")


def huge_mapped_kib(address: int) -> int:
    """FilePmdMapped (KiB) of the mapping that starts at `address`."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            if "-" in line.split()[0] and not line.startswith(("FilePmdMapped", "Size")):
                inside = int(line.split("-")[0], 16) == address
            elif inside and line.startswith("FilePmdMapped:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drop-cache", action="store_true", help="drop the file from the page cache first")
    args = parser.parse_args()
    path = str(resolve(args.model, quiet=True).path)
    if args.drop_cache:
        with open(path, "rb") as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    huge, huge_base = mapping(path, mmap.MADV_HUGEPAGE)
    np.frombuffer(huge, dtype=np.uint8)[:: mmap.PAGESIZE].sum()  # read through the 2 MiB mapping first
    small, small_base = mapping(path, mmap.MADV_NOHUGEPAGE)
    model = load_model(path, "auto", quiet=True)
    module = model.module
    own_base = file_base(path)
    # the projections' weights (the embedding is looked up a row per token)
    segments = [m.matrix().segments for m in module.modules() if isinstance(m, BlockProjection)]
    counts = [m.matrix().num_segments for m in module.modules() if isinstance(m, BlockProjection)]
    offsets = [
        [parts[i].data - own_base for i in range(n)] for parts, n in zip(segments, counts, strict=True)
    ]

    def point_at(base: int) -> None:
        for parts, part_offsets in zip(segments, offsets, strict=True):
            for index, offset in enumerate(part_offsets):
                parts[index].data = base + offset

    per_sequence = -(-(args.context + 1) // BLOCK)
    cache = PagedKVCache(module.config, per_sequence, BLOCK, model.kv_dtype)
    table = tuple(range(per_sequence))
    module(
        build_forward_batch(
            [SequenceChunk(tuple(range(100, 100 + args.context)), 0, table)], BLOCK, module.config
        ),
        cache,
    )
    batch = build_forward_batch([SequenceChunk((42,), args.context, table)], BLOCK, module.config)
    systems = {"4 KiB pages": small_base, "2 MiB pages": huge_base}
    rounds: dict[str, list[float]] = {name: [] for name in systems}
    for round_index in range(args.rounds):
        order = list(systems) if round_index % 2 == 0 else list(systems)[::-1]
        for name in order:
            point_at(systems[name])
            for _ in range(3):
                module(batch, cache)
            times = []
            for _ in range(args.steps):
                started = time.perf_counter()
                module(batch, cache)
                times.append(time.perf_counter() - started)
            rounds[name].append(statistics.median(times) * 1e3)
    point_at(own_base)
    mapped = {name: huge_mapped_kib(base) for name, base in systems.items()}
    size_kib = os.path.getsize(path) // 1024
    print(
        f"{args.model} auto ({model.compute_path}), batch 1 after {args.context} tokens: ms per decode step"
    )
    print("| mapping | median step per round (ms) | best round | mapped with 2 MiB pages |")
    print("|---|---|---:|---:|")
    for name in systems:
        per_round = ", ".join(f"{value:.2f}" for value in rounds[name])
        print(f"| {name} | {per_round} | {min(rounds[name]):.2f} | {mapped[name] / size_kib:.0%} |")
    ratio = min(rounds["4 KiB pages"]) / min(rounds["2 MiB pages"])
    print(f"2 MiB pages: {ratio:.2f}× the 4 KiB pages' speed (best rounds)")
    print(
        json.dumps(
            {
                "model": args.model,
                "context": args.context,
                "ms_per_step": rounds,
                "huge_mapped_kib": mapped,
                "file_kib": size_kib,
                "speedup": ratio,
            }
        )
    )
    del huge, small


if __name__ == "__main__":
    main()
