"""A decode step over a GGUF file's weights mapped with 4 KiB pages against 2 MiB pages, side by
side in one run.

Run:  python bench/page_size.py [--model qwen2.5-coder-1.5b-instruct] [--context 64] [--steps 30]
      [--rounds 3] [--batch 1] [--drop-cache]

The model loads at dtype auto (the file's blocks in place; its mapping asks for 2 MiB pages,
`runtime/loading/gguf_file.py`). Its projections' weight pointers are then switched between three copies of
the same bytes:
- "written copy": a temporary copy of the file written in 1 MiB pieces, as a download leaves a
  file in the page cache, mapped with MADV_HUGEPAGE like the model's own;
- "copy read 4 KiB at a time": another copy, dropped from the page cache and read back 4 KiB at a
  time without readahead, so that the cache holds it in 4 KiB pages scattered in memory (what a
  long-running machine's cache can hold), mapped the same way;
- "the model's mapping": the file as polylane maps it (with --drop-cache the file is dropped from
  the page cache before the load, so its first read goes through the 2 MiB mapping);
- "anonymous 2 MiB pages": a copy in anonymous memory advised MADV_HUGEPAGE (the best case).
Each round times --steps decode steps (--batch sequences, one new token each after --context
tokens, the native stack where it runs) on each, in rotating order; reported: the median step per
round, the best round, and how much of each mapping the kernel mapped with 2 MiB pages (/proc/self/smaps
`FilePmdMapped`, `AnonHugePages`). The last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from polylane.catalog import resolve
from polylane.runtime.kv.kv_cache import PagedKVCache
from polylane.runtime.loading.loaded_model import load_model
from polylane.runtime.model.batch import build_forward_batch
from polylane.runtime.model.block_weights import BlockProjection
from polylane.types import SequenceChunk

BLOCK = 16
HUGE = 1 << 21


def file_mapping(path: str) -> tuple[mmap.mmap, int]:
    with open(path, "rb") as handle:
        view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    view.madvise(mmap.MADV_HUGEPAGE)
    return view, np.frombuffer(view, dtype=np.uint8).ctypes.data


def scattered_copy(source: str, path: str) -> None:
    """A copy of `source` at `path` that the page cache holds in 4 KiB pages, read one at a time."""
    shutil.copyfile(source, path)
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
        os.posix_fadvise(handle, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(handle, 0, 0, os.POSIX_FADV_RANDOM)
        offset = 0
        while os.pread(handle, mmap.PAGESIZE, offset):
            offset += mmap.PAGESIZE
    finally:
        os.close(handle)


def anonymous_copy(path: str) -> tuple[mmap.mmap, int]:
    size = os.path.getsize(path)
    view = mmap.mmap(-1, (size + HUGE - 1) // HUGE * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view.madvise(mmap.MADV_HUGEPAGE)
    with open(path, "rb") as handle:
        handle.readinto(memoryview(view)[:size])
    return view, np.frombuffer(view, dtype=np.uint8).ctypes.data


def own_mapping(path: str) -> int:
    """The address the model's own mapping of `path` starts at (offset 0), from /proc/self/maps."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == real and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16)
    raise SystemExit(f"the model's mapping of {real} was not found")


def huge_share(address: int) -> float:
    """The share of the mapping starting at `address` that is mapped with 2 MiB pages."""
    fields: dict[str, int] = {}
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == address
            elif inside and head in ("Size:", "FilePmdMapped:", "AnonHugePages:"):
                fields[head] = int(line.split()[1])
    return (fields.get("FilePmdMapped:", 0) + fields.get("AnonHugePages:", 0)) / max(
        fields.get("Size:", 1), 1
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together in each step")
    parser.add_argument("--drop-cache", action="store_true", help="drop the file from the page cache first")
    args = parser.parse_args()
    path = str(resolve(args.model, quiet=True).path)
    if args.drop_cache:
        with open(path, "rb") as handle:
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    model = load_model(path, "auto", quiet=True)
    module = model.module
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as folder:
        copy = os.path.join(folder, "written.gguf")
        with open(path, "rb") as source, open(copy, "wb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
        written, written_base = file_mapping(copy)
        scattered_path = os.path.join(folder, "scattered.gguf")
        scattered_copy(path, scattered_path)
        scattered, scattered_base = file_mapping(scattered_path)
        anonymous, anonymous_base = anonymous_copy(path)
        base = own_mapping(path)
        # the projections' weights (the embedding is looked up a row per token)
        matrices = [m.matrix() for m in module.modules() if isinstance(m, BlockProjection)]
        offsets = [
            [matrix.segments[i].data - base for i in range(matrix.num_segments)] for matrix in matrices
        ]

        def point_at(start: int) -> None:
            for matrix, matrix_offsets in zip(matrices, offsets, strict=True):
                for index, offset in enumerate(matrix_offsets):
                    matrix.segments[index].data = start + offset

        per_sequence = -(-(args.context + 1) // BLOCK)
        cache = PagedKVCache(module.config, per_sequence * args.batch, BLOCK, model.kv_dtype)
        tables = [tuple(range(per_sequence * s, per_sequence * (s + 1))) for s in range(args.batch)]
        for s, table in enumerate(tables):
            prompt = SequenceChunk(tuple(range(100 + s, 100 + s + args.context)), 0, table)
            module(build_forward_batch([prompt], BLOCK, module.config), cache)
        chunks = [SequenceChunk((42 + s,), args.context, table) for s, table in enumerate(tables)]
        batch = build_forward_batch(chunks, BLOCK, module.config)
        systems = {
            "written copy": written_base,
            "copy read 4 KiB at a time": scattered_base,
            "the model's mapping": base,
            "anonymous 2 MiB pages": anonymous_base,
        }
        names = list(systems)
        rounds: dict[str, list[float]] = {name: [] for name in names}
        for round_index in range(args.rounds):
            for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
                point_at(systems[name])
                for _ in range(3):
                    module(batch, cache)
                times = []
                for _ in range(args.steps):
                    started = time.perf_counter()
                    module(batch, cache)
                    times.append(time.perf_counter() - started)
                rounds[name].append(statistics.median(times) * 1e3)
        shares = {name: huge_share(start) for name, start in systems.items()}
        point_at(base)
        del written, scattered, anonymous
    print(f"{args.model} auto ({model.compute_path})")
    print(f"batch {args.batch} after {args.context} tokens, ms per decode step")
    print("| weights | median step per round (ms) | best round | mapped with 2 MiB pages |")
    print("|---|---|---:|---:|")
    for name in names:
        per_round = ", ".join(f"{value:.2f}" for value in rounds[name])
        print(f"| {name} | {per_round} | {min(rounds[name]):.2f} | {shares[name]:.0%} |")
    summary = {
        "model": args.model,
        "batch": args.batch,
        "context": args.context,
        "ms_per_step": rounds,
        "huge_share": shares,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
