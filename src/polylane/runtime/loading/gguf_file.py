"""A GGUF file: header parsed here, tensor data memory-mapped, dequantised by the `gguf` package.

The `gguf` package's own reader builds a numpy view for every element of every metadata array,
which takes seconds for a 262,144-token vocabulary; this reader walks the header once, skips
the token tables (the tokenizer reads them itself) and checks that every tensor lies inside the
file. Layout (version 2 and 3): magic "GGUF", version, tensor count, key/value count, the
key/value pairs, the tensor infos, padding to `general.alignment`, then the tensor data.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

GGUF_MAGIC = b"GGUF"
_SCALARS = {  # value type → struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
# Arrays this large are skipped rather than decoded (token lists, merges, scores).
_MAX_DECODED_ARRAY = 4096


FLOAT32_TYPE, FLOAT16_TYPE, BFLOAT16_TYPE = 0, 1, 30
FLOAT_TYPES = (FLOAT32_TYPE, FLOAT16_TYPE, BFLOAT16_TYPE)
# ggml type id → (bytes per block, byte offsets of the block's float16 scales): the formats with
# kernels (`runtime.model.block_weights`) and the other common ones (Q2_K, Q3_K, IQ4_NL, IQ4_XS).
HALF_SCALE_OFFSETS = {
    2: (18, (0,)), 3: (20, (0, 2)), 6: (22, (0,)), 7: (24, (0, 2)), 8: (34, (0,)),
    10: (84, (80, 82)), 11: (110, (108,)), 12: (144, (0, 2)), 13: (176, (0, 2)), 14: (210, (208,)),
    20: (18, (0,)), 23: (136, (0,)),
}  # fmt: skip


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: rows (outer) first
    type_id: int
    offset: int  # absolute byte offset in the file
    num_bytes: int


class _Cursor:
    def __init__(self, handle: BinaryIO, size: int) -> None:
        self.handle = handle
        self.size = size

    def read(self, n: int) -> bytes:
        data = self.handle.read(n)
        if len(data) != n:
            raise GGUFFormatError(
                f"truncated file: the header ends early, at byte {self.handle.tell():,} of {self.size:,}"
            )
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.unpack("<Q")
        if length > self.size:
            raise GGUFFormatError(
                f"truncated or corrupt header: string length {length:,} exceeds the file size"
            )
        return self.read(length).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Skips `count` strings (a tokenizer's vocabulary: 150k of them) by walking their lengths in
        a mapping of the file, five times faster than reading each through the file object."""
        position = self.handle.tell()
        with mmap.mmap(self.handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
            for _ in range(count):
                if position + 8 > self.size:
                    raise GGUFFormatError(
                        f"truncated file: the header ends early, at byte {position:,} of {self.size:,}"
                    )
                length = struct.unpack_from("<Q", view, position)[0]
                if length > self.size:
                    raise GGUFFormatError(
                        f"truncated or corrupt header: string length {length:,} exceeds the file size"
                    )
                position += 8 + length
        self.handle.seek(position)  # (past the end if the last string is cut: the next read says so)

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if count > self.size:
                raise GGUFFormatError(
                    f"truncated or corrupt header: array length {count:,} exceeds the file size"
                )
            if count > _MAX_DECODED_ARRAY:
                self.skip_array(item_type, count)
                return SkippedArray(item_type, count)
            return [self.value(item_type) for _ in range(count)]
        raise GGUFFormatError(f"unknown metadata value type {value_type}")

    def skip_array(self, item_type: int, count: int) -> None:
        if item_type in _SCALARS:
            self.handle.seek(struct.calcsize(_SCALARS[item_type]) * count, 1)
        elif item_type == _STRING:
            self.skip_strings(count)
        else:
            for _ in range(count):
                self.value(item_type)


@dataclass(frozen=True)
class SkippedArray:
    """A long metadata array that was not decoded: only its element type and length are kept."""

    item_type: int
    length: int


class GGUFFile:
    """Metadata and tensor infos of a GGUF file, with its data memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        size = self.path.stat().st_size
        with self.path.open("rb") as handle:
            cursor = _Cursor(handle, size)
            magic = cursor.read(4)
            if magic != GGUF_MAGIC:
                raise GGUFFormatError(f"bad magic {magic!r} (expected {GGUF_MAGIC!r})")
            version = cursor.unpack("<I")
            if version not in (2, 3):
                raise GGUFFormatError(f"unsupported GGUF version {version}")
            tensor_count, kv_count = cursor.unpack("<Q"), cursor.unpack("<Q")
            if tensor_count > size or kv_count > size:
                raise GGUFFormatError(
                    f"truncated or corrupt header: {tensor_count:,} tensors and {kv_count:,} keys "
                    f"cannot fit in {size:,} bytes"
                )
            self.metadata: dict[str, Any] = {}
            for _ in range(kv_count):
                key = cursor.string()
                self.metadata[key] = cursor.value(cursor.unpack("<I"))
            infos = []
            for _ in range(tensor_count):
                name = cursor.string()
                n_dims = cursor.unpack("<I")
                if n_dims > 8:
                    raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions")
                dims = [cursor.unpack("<Q") for _ in range(n_dims)]
                infos.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
            alignment = int(self.metadata.get("general.alignment", 32))
            data_start = -(-handle.tell() // alignment) * alignment
        self.header_bytes = data_start  # the metadata and tensor infos: everything but tensor data

        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, type_id, offset in infos:
            try:
                quant_type = gguf.GGMLQuantizationType(type_id)
                block_elements, block_bytes = gguf.GGML_QUANT_SIZES[quant_type]
            except (ValueError, KeyError):
                raise GGUFFormatError(f"tensor {name!r} has unknown type id {type_id}") from None
            num_elements = int(np.prod(dims)) if dims else 1
            num_bytes = num_elements // block_elements * block_bytes
            start = data_start + offset
            if start + num_bytes > size:
                raise GGUFFormatError(
                    f"truncated file: tensor {name!r} ends at byte {start + num_bytes:,} "
                    f"but the file has {size:,} bytes"
                )
            self.tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), type_id, start, num_bytes)
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r") if self.tensors else None
        if self._data is not None:
            _ask_for_huge_pages(self._data)

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` dequantised to float32, in numpy order (out × in)."""
        import gguf

        info = self.tensors[name]
        quant_type = gguf.GGMLQuantizationType(info.type_id)
        raw = self._data[info.offset : info.offset + info.num_bytes]
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        values = gguf.quants.dequantize(raw.reshape(rows, -1), quant_type)
        return np.asarray(values, dtype=np.float32).reshape(info.shape)

    def raw(self, name: str) -> np.ndarray:
        """Tensor `name`'s bytes as they lie in the mapping (a read-only view, rows × bytes per
        row; nothing is read until used)."""
        info = self.tensors[name]
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return self._data[info.offset : info.offset + info.num_bytes].reshape(rows, -1)

    def nonfinite_count(self, name: str) -> int | None:
        """How many of tensor `name`'s floats are NaN or infinite: its values (F32, F16, BF16) or its
        blocks' float16 scales (the formats of HALF_SCALE_OFFSETS: a block's values are finite
        exactly when its scales are, the codes being integers); None for another format (then its
        dequantised values tell). Reads the floats' bytes only, straight from the mapping."""
        info = self.tensors[name]
        data = self._data[info.offset : info.offset + info.num_bytes]
        if info.type_id == FLOAT32_TYPE:
            return int(np.count_nonzero(~np.isfinite(data.view(np.float32))))
        if info.type_id == FLOAT16_TYPE:
            return int(np.count_nonzero((data[1::2] & 0x7C) == 0x7C))  # all five exponent bits set
        if info.type_id == BFLOAT16_TYPE:
            return int(np.count_nonzero((data.view(np.uint16) & 0x7F80) == 0x7F80))
        if info.type_id not in HALF_SCALE_OFFSETS:
            return None
        block_bytes, offsets = HALF_SCALE_OFFSETS[info.type_id]
        blocks = data.reshape(-1, block_bytes)
        return sum(int(np.count_nonzero((blocks[:, offset + 1] & 0x7C) == 0x7C)) for offset in offsets)

    def type_name(self, name: str) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.tensors[name].type_id).name


def _ask_for_huge_pages(data: np.memmap) -> None:
    """Ask the kernel to map the file's tensors with 2 MiB pages where it can (Linux, transparent
    huge pages in `madvise` or `always` mode, a file system with large folios such as ext4): a page
    cache read through this mapping fills 2 MiB folios, and they are mapped whole, so a decode step
    that streams every weight walks 512 times fewer page table entries. On the machine measured
    (AMD EPYC Zen 4) the step time did not move measurably with it (`bench/page_size.py`: Qwen2.5-Coder
    1.5B within the run-to-run noise of ±10% over 4 KiB and 2 MiB pages); it costs nothing. Pages
    already cached in smaller folios stay so until the cache drops them; nothing changes where the
    advice is not supported."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    view = getattr(data, "_mmap", None)
    if advice is None or view is None:
        return
    with contextlib.suppress(OSError):  # (a kernel without transparent huge pages)
        view.madvise(advice)
