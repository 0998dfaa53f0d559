"""A GGUF file's tensors used as they lie in the file: projections and embeddings over its blocks.

What this module owns: the modules that compute with GGUF's own block formats (blocks.c) straight
from the file's memory mapping — `BlockProjection` (y = x·Wᵀ + b, W one or more tensors fused
by rows, each in its own format, Q/K rows read through a row map instead of being reordered) and
`BlockEmbedding` (rows looked up and dequantised per token) — and which formats have kernels.
Nothing is converted or copied: the modules hold uint8 views of the mapping as buffers (so a
model's byte count and its digests see the file's bytes), and the C code reads them in place.

The arithmetic, per matrix (`activation_bits`): weights dequantised block by block as ggml defines
them times float32 activations (32, blocks.c), or the blocks' integer codes times activations
rounded to 8 bits per group of 16 (8, blocks_q8.c); either way each output is the same operations
whatever its batch, so decode, verify and speculation agree exactly on one machine.
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from polylane.runtime.model.native import abi
from polylane.runtime.model.native.build import NATIVE_ENV, enabled, load_library

# ggml type ids with a kernel in blocks.c, by name
BLOCK_FORMATS = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
    "Q6_K": 14, "BF16": 30,
}  # fmt: skip
FORMAT_NAMES = {type_id: name for name, type_id in BLOCK_FORMATS.items()}
ISA_NAMES = {0: "portable C", 1: "avx2", 2: "avx512"}
ACTIVATION_BITS = (32, 8)

_pointer = ctypes.c_void_p


class Segment(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int64),
        ("data", _pointer),
        ("rows", ctypes.c_int64),
        ("row_map", _pointer),
    ]


class BlockMatrix(ctypes.Structure):
    _fields_ = [
        ("in_features", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
        ("num_segments", ctypes.c_int64),
        ("segments", ctypes.POINTER(Segment)),
        ("bias", _pointer),
        ("activation_bits", ctypes.c_int64),
    ]


def check_bits(activation_bits: int) -> int:
    """`activation_bits` if the kernels have it: 32 (float32 activations, the products of the file's
    values) or 8 (activations rounded to 8 bits per group of 16, integer dot products)."""
    if activation_bits not in ACTIVATION_BITS:
        raise ValueError(f"activation bits must be one of {ACTIVATION_BITS}, got {activation_bits}")
    return activation_bits


class BlockKernelsUnavailable(RuntimeError):
    """The block kernels cannot be built or loaded here (no C compiler, or native code is off)."""


def library() -> ctypes.CDLL:
    """blocks.c compiled for this machine; BlockKernelsUnavailable where it cannot be."""
    lib = load_library("blocks")
    if lib is None:
        if not enabled():
            raise BlockKernelsUnavailable(f"native kernels are turned off ({NATIVE_ENV}=0)")
        raise BlockKernelsUnavailable("the GGUF block kernels need a C compiler (cc or gcc); see the log")
    if not getattr(lib, "_polylane_typed", False):
        abi.check(lib, "blocks", "polylane_blocks_abi", [Segment, BlockMatrix])
        lib.polylane_blocks_matmul.argtypes = [
            ctypes.POINTER(BlockMatrix),
            _pointer,
            ctypes.c_int64,
            _pointer,
            ctypes.c_int,
        ]
        lib.polylane_blocks_matmul.restype = ctypes.c_int
        lib.polylane_blocks_check.argtypes = [ctypes.POINTER(BlockMatrix)]
        lib.polylane_blocks_check.restype = ctypes.c_int
        lib.polylane_blocks_rows.argtypes = [
            ctypes.c_int64,
            _pointer,
            ctypes.c_int64,
            _pointer,
            ctypes.c_int64,
            _pointer,
        ]
        lib.polylane_blocks_rows.restype = None
        lib.polylane_blocks_isa.restype = ctypes.c_int
        lib._polylane_typed = True
    return lib


def isa_name() -> str:
    """The instruction set the block kernels were built for here ("avx512", "avx2", "portable C")."""
    return ISA_NAMES[library().polylane_blocks_isa()]


def file_bytes(array: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over a (read-only) memory-mapped array, sharing its memory: never written."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the mapping is read-only
        return torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


@dataclass(frozen=True)
class BlockTensor:
    """One tensor of a GGUF file as its raw bytes: `rows` rows of `columns` elements of `type_id`."""

    name: str
    type_id: int
    rows: int
    columns: int
    data: np.ndarray  # uint8 view of the mapping, rows × bytes per row

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES.get(self.type_id, f"type {self.type_id}")


def unsupported(tensor: BlockTensor) -> str | None:
    """Why no kernel takes this tensor (its format, or a row not made of whole blocks), or None."""
    if tensor.type_id not in FORMAT_NAMES:
        import gguf

        try:
            name = gguf.GGMLQuantizationType(tensor.type_id).name
        except ValueError:
            name = f"type id {tensor.type_id}"
        return f"tensor {tensor.name!r} is {name}, a format without a polylane kernel"
    if tensor.columns % 32:
        return f"tensor {tensor.name!r} has {tensor.columns} columns, not a multiple of 32"
    return None


class BlockProjection(nn.Module):
    """y = x·Wᵀ + b with W the rows of one or more file tensors (fused QKV or gate/up), in place."""

    def __init__(
        self,
        parts: list[BlockTensor],
        row_maps: list[np.ndarray | None],
        bias: bool = False,
        activation_bits: int = 32,
    ) -> None:
        super().__init__()
        columns = {part.columns for part in parts}
        if len(columns) != 1:
            raise ValueError(
                f"tensors {[p.name for p in parts]} have different row lengths {sorted(columns)}"
            )
        self.in_features = columns.pop()
        self.out_features = sum(part.rows for part in parts)
        self.formats = tuple(part.format_name for part in parts)
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None
        self._segments = (Segment * len(parts))()
        for index, (part, row_map) in enumerate(zip(parts, row_maps, strict=True)):
            self.register_buffer(f"blocks_{index}", file_bytes(part.data), persistent=True)
            if row_map is not None:
                self.register_buffer(
                    f"row_map_{index}", torch.from_numpy(np.asarray(row_map, dtype=np.int64))
                )
            self._segments[index].type = part.type_id
            self._segments[index].rows = part.rows
        self._num_segments = len(parts)
        self._matrix = BlockMatrix(
            self.in_features, self.out_features, len(parts), self._segments, None, check_bits(activation_bits)
        )
        self.bind()
        problem = library().polylane_blocks_check(ctypes.byref(self._matrix))
        if problem:
            raise ValueError(f"tensors {[p.name for p in parts]} do not fit the block kernels")

    def bind(self) -> None:
        """Point the C description at the current buffers and bias (after a loader replaces the bias
        parameter, and after every `_apply`)."""
        for index in range(self._num_segments):
            self._segments[index].data = getattr(self, f"blocks_{index}").data_ptr()
            row_map = getattr(self, f"row_map_{index}", None)
            self._segments[index].row_map = None if row_map is None else row_map.data_ptr()
        self._matrix.bias = None if self.bias is None else self.bias.data_ptr()

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self.bind()
        return result

    def matrix(self) -> BlockMatrix:
        """The C description of this weight (see `bind`; valid while the module lives)."""
        return self._matrix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features).float().contiguous()
        y = torch.empty(x.shape[0], self.out_features)
        if library().polylane_blocks_matmul(
            ctypes.byref(self._matrix), x.data_ptr(), x.shape[0], y.data_ptr(), torch.get_num_threads()
        ):
            raise MemoryError("the block matmul could not allocate its scratch memory")
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, formats={'+'.join(self.formats)}"


class BlockEmbedding(nn.Module):
    """Token rows of a file tensor (vocab × hidden), dequantised to float32 when looked up."""

    def __init__(self, tensor: BlockTensor) -> None:
        super().__init__()
        self.type_id = tensor.type_id
        self.format = tensor.format_name
        self.num_embeddings, self.embedding_dim = tensor.rows, tensor.columns
        self.register_buffer("blocks_0", file_bytes(tensor.data))
        self._segment = Segment(tensor.type_id, None, tensor.rows, None)
        # rows are only looked up (a tied output matrix is a BlockProjection over the same tensor)
        self._matrix = BlockMatrix(tensor.columns, tensor.rows, 1, ctypes.pointer(self._segment), None, 32)

    def matrix(self) -> BlockMatrix:
        """The table as a C weight description (one segment, vocab rows; valid while this lives)."""
        self._segment.data = self.blocks_0.data_ptr()
        return self._matrix

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        ids = token_ids.reshape(-1).to(torch.int64).contiguous()
        if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.num_embeddings:
            raise IndexError(
                f"token ids must lie in [0, {self.num_embeddings}), got {ids.min()}..{ids.max()}"
            )
        out = torch.empty(ids.shape[0], self.embedding_dim)
        library().polylane_blocks_rows(
            self.type_id,
            self.blocks_0.data_ptr(),
            self.embedding_dim,
            ids.data_ptr(),
            ids.shape[0],
            out.data_ptr(),
        )
        return out.reshape(*token_ids.shape, self.embedding_dim)


def block_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, BlockProjection | BlockEmbedding)]


def formats_summary(model: nn.Module) -> str:
    """ "Q4_K ×169, Q6_K ×29": how many of a model's file tensors are used in each format."""
    counts: dict[str, int] = {}
    for module in block_modules(model):
        for name in module.formats if isinstance(module, BlockProjection) else (module.format,):
            counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} ×{count}" for name, count in sorted(counts.items(), key=lambda kv: -kv[1]))


__all__ = [
    "BLOCK_FORMATS",
    "BlockEmbedding",
    "BlockKernelsUnavailable",
    "BlockProjection",
    "BlockTensor",
    "formats_summary",
    "isa_name",
    "library",
    "unsupported",
]
