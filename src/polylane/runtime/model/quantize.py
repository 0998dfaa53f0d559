"""Weight-only quantised twins: a model's projections re-stored as int4 or int8 for drafting.

What this module owns: turning a loaded float32 `DecoderModel` into its quantised twin in place.
Every `Projection` (fused QKV, attention output, fused gate/up, down, and the output projection,
which a tied-embedding model gets as a separate quantised copy of its embedding matrix) is
replaced by a `QuantizedProjection` running torch's weight-only kernels, which take bf16
activations (PERF.md: the activation dtype decides whether the fast kernel runs):

- int4: `aten._weight_int4pack_mm_for_cpu`, asymmetric, one scale and zero per group of 32 input
  columns: w ≈ (q − 8)·scale + zero with q in [0, 15] (int8 where a shape does not pack).
- int8: `aten._weight_int8pack_mm`, symmetric, one scale per output row: w ≈ q·scale.

From a few dozen rows (prefill) either runs as dense bf16 GEMMs instead: int4 on its dequantised
weight, int8 on its codes (exact in bf16) with the scales after.

A projection is built on the host in the CPU kernels' layout; `place` moves it to a CUDA device:
int4 re-packed for `aten._weight_int4pack_mm` (tinygemm, the same (q − 8)·scale + zero with the
same scales and zeros), int8 as it is, multiplied as (x · qᵀ) · scale in bf16 (q is exact in bf16).

Everything else runs in float32 as in the target: each projection casts its input to bf16 and
its output back (measured on SmolLM2, one thread: a decode step of 23 ms this way against 39 ms
with bf16 activations throughout, on a CPU without bf16 units; the fp32 target took 104 ms). The
token embedding is kept in bf16 and looked up into float32 (`Bf16Embedding`). The twin is a
drafter: its numbers only need to agree with the target's often; the target's verify keeps the
output exact.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from polylane.runtime.model.int4_layout import Int4Layout, packing_layout
from polylane.runtime.model.layers import Projection, linear
from polylane.runtime.models.base import DecoderModel

QUANTISED_FORMATS = {"int4": 4, "int8": 8}
INT4_GROUP = 32
# From this many rows an int4 projection dequantises its weight to bf16 and runs a dense GEMM:
# torch's int4 kernel streams the packed weight once per call but computes slowly at many rows
# (SmolLM2 int4 prefill of 512 tokens: 434 tokens/s against 861 for llama.cpp), while the
# unpacking costs about one pass over the weight. Decode steps and verify passes stay below it.
DEQUANTIZE_MIN_ROWS = 128
# int8 the same way from 32 rows, its codes as bf16 (exact) and the row scales after the GEMM:
# SmolLM2's gate/up (3,072 × 576), ms per call, torch's int8 kernel against the bf16 GEMM: 8 rows
# 0.22 / 0.29, 16 rows 0.34 / 0.30, 32 rows 0.68 / 0.33, 512 rows 11.2 / 1.18 (2 threads, AMX;
# `python bench/int8_gemm.py`, which also times the down and QKV shapes).
INT8_GEMM_MIN_ROWS = 32
# The weight is dequantised a slice of output rows at a time, each slice's float32 transient under
# this many elements (16 MiB: below glibc's mmap threshold at run time, so it reuses heap memory).
DEQUANTIZE_BLOCK_ELEMENTS = 1 << 22


# Codes are computed a slice of output rows at a time, each slice's float32 transient under this
# many elements: the same elementwise operations, bit for bit, without whole-matrix temporaries
# (Gemma 3's 262k x 640 output projection: 0.3 s instead of 1.3-1.7 s).
QUANTIZE_BLOCK_ELEMENTS = 1 << 20


def _codes(
    values: torch.Tensor,
    scale: torch.Tensor,
    low: torch.Tensor | None,
    lowest: int,
    highest: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """round((values − low) / scale) clamped to [lowest, highest], as `dtype`; `scale` and `low`
    broadcast over `values` and share its first (output-row) dimension."""
    rows = values.shape[0]
    codes = torch.empty(values.shape, dtype=dtype)
    step = max(1, QUANTIZE_BLOCK_ELEMENTS // max(1, values[0].numel()))
    for a in range(0, rows, step):
        b = min(rows, a + step)
        part = values[a:b] - low[a:b] if low is not None else values[a:b].clone()
        codes[a:b] = part.div_(scale[a:b]).round_().clamp_(lowest, highest)
    return codes


class QuantizedProjection(nn.Module):
    """y = x Wᵀ + b with W stored int4 (grouped) or int8 (per row); x is cast to bf16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bits: int) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"only int4 and int8 weights are supported, got {bits} bits")
        weight = weight.detach().float().contiguous()  # (N, K)
        out_features, in_features = weight.shape
        self.bits = bits
        self.in_features, self.out_features = in_features, out_features
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        )
        if bits == 8:
            scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0  # (N,)
            q = _codes(weight, scale[:, None], None, -127, 127, torch.int8)
            self.register_buffer("qweight", q)
            self.register_buffer("scales", scale.to(torch.bfloat16))
            return
        if in_features % INT4_GROUP or out_features % 16:
            raise ValueError(
                f"int4 needs input features divisible by {INT4_GROUP} and output features by 16, "
                f"got {in_features} and {out_features}"
            )
        groups = weight.view(out_features, in_features // INT4_GROUP, INT4_GROUP)
        low = groups.amin(dim=-1, keepdim=True)
        high = groups.amax(dim=-1, keepdim=True)
        scale = (high - low).clamp(min=1e-8) / 15.0
        q = _codes(groups, scale, low, 0, 15, torch.int32).view(out_features, in_features)
        zero = low + 8 * scale
        # (K / group, N, 2): scale and zero per group and output row
        scales_and_zeros = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1)
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales", scales_and_zeros.contiguous().to(torch.bfloat16))

    @property
    def on_cpu(self) -> bool:
        return self.qweight.device.type == "cpu"

    def place(self, device: torch.device) -> None:
        """Move to `device`, re-packing the int4 weight for that device's kernel (CUDA)."""
        if device.type == "cpu" or not self.on_cpu:
            return
        if device.type not in ("cuda", "meta"):  # meta: shapes only (tests check placement on it)
            raise ValueError(f"quantised projections run on CPU or CUDA, not {device}")
        if self.bits == 4:
            q = self.nibbles()  # (N, K): 0..15
            packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)  # even column high
            inner_k_tiles = next(t for t in (8, 4, 2) if self.in_features % (16 * t) == 0)
            self.qweight = torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles)
        else:
            self.qweight = self.qweight.to(device)
        self.scales = self.scales.to(device)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.to(device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x16 = x.to(torch.bfloat16)
        if not self.on_cpu:
            if self.bits == 8:
                y = F.linear(x16, self.qweight.to(torch.bfloat16)) * self.scales
            else:
                y = torch.ops.aten._weight_int4pack_mm(x16, self.qweight, INT4_GROUP, self.scales)
        elif self._dense_rows(x16.shape[0]):
            # many rows (prefill): bf16 slices of the weight and dense GEMMs beat torch's
            # quantised kernels, which are fast only for a few rows (DEQUANTIZE_MIN_ROWS, INT8_GEMM_MIN_ROWS)
            unit = 64 if self.bits == 8 else math.lcm(64, self.packing_layout.block_rows)  # whole blocks
            step = max(unit, DEQUANTIZE_BLOCK_ELEMENTS // self.in_features // unit * unit)
            bounds = [(a, min(a + step, self.out_features)) for a in range(0, self.out_features, step)]
            parts = [self._dense_slice(x16, a, b) for a, b in bounds]
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        elif self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(x16, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x16, self.qweight, INT4_GROUP, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)

    def _dense_rows(self, rows: int) -> bool:
        """Whether `rows` rows go through dense bf16 GEMMs (on the host) instead of the kernel."""
        if self.bits == 8:
            return rows >= INT8_GEMM_MIN_ROWS
        return rows >= DEQUANTIZE_MIN_ROWS and self.packing_layout is not None

    def _dense_slice(self, x16: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """x16 times output rows [start, stop) of the weight, through a dense bf16 GEMM."""
        if self.bits == 8:  # int8 codes are exact in bf16; each row's scale after the sums
            codes = self.qweight[start:stop].to(torch.bfloat16)
            return linear(x16, codes, None, input_major=False) * self.scales[start:stop]
        return linear(x16, self.dequantized_bf16(start, stop), None, input_major=False)

    def dequantized_bf16(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of the int4 weight (N, K) as bf16: the very weight torch's int4 kernel
        multiplies by (see `dequantized_float`)."""
        return self.dequantized_float(start, stop).to(torch.bfloat16)

    def dequantized_float(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of the int4 weight (N, K), (q - 8) · scale + zero in float32, the codes
        unpacked from torch's CPU packing (see `nibbles`). A transient copy: nothing is kept."""
        stop = self.out_features if stop is None else stop
        n, k = stop - start, self.in_features
        q = self.nibbles(start, stop).view(n, k // INT4_GROUP, INT4_GROUP)
        scales, zeros = self.scales[:, start:stop].permute(2, 1, 0)[:, :, :, None]  # (n, K / group, 1)
        return ((q.float() - 8) * scales.float() + zeros.float()).view(n, k)

    def nibbles(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of the int4 codes q (N, K) in [0, 15], read from torch's CPU packing in
        the layout this process's torch uses (`runtime.model.int4_layout`; rows in whole blocks of it).
        Where that layout is unknown or N is not whole blocks, torch's own kernel gives the codes
        (its product with the identity at scale 1 and zero 0 is q − 8): exact, but a GEMM."""
        if self.bits != 4 or not self.on_cpu:
            raise ValueError("only a CPU-packed int4 projection unpacks its codes")
        stop = self.out_features if stop is None else stop
        layout = self.packing_layout
        if layout is not None:
            return layout.unpack(self.qweight, self.in_features, start, stop)
        unit = torch.zeros_like(self.scales)
        unit[..., 0] = 1
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        codes = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, INT4_GROUP, unit)
        return (codes.t()[start:stop].float() + 8).to(torch.uint8)

    @property
    def packing_layout(self) -> Int4Layout | None:
        """The layout the packed int4 weight is read in; None: ask torch's kernel (see `nibbles`)."""
        layout = packing_layout()
        if layout is None or self.out_features % layout.block_rows:
            return None
        return layout

    def dequantized(self) -> torch.Tensor:
        """The weight (N, K) float32 this projection multiplies by (for tests)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.qweight.device)
        bias, self.bias = self.bias, None
        try:
            return self.forward(eye).float().t()
        finally:
            self.bias = bias


def quantize_model(model: DecoderModel, fmt: str) -> DecoderModel:
    """Replace every projection of a float32 model by its `fmt` ("int4" | "int8") twin, in place."""
    if fmt not in QUANTISED_FORMATS:
        raise ValueError(f"unknown quantised format {fmt!r} (choose from {', '.join(QUANTISED_FORMATS)})")
    bits = QUANTISED_FORMATS[fmt]
    if model.weight_dtype != torch.float32:
        raise ValueError("a quantised twin is built from the float32 model (float32 activations)")
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Projection):
                weight = child.weight.t() if child.input_major else child.weight
                setattr(module, child_name, _quantized(weight, child.bias, bits))
    if model.lm_head is None:
        # tied embeddings: the output projection gets its own quantised copy, the lookup a bf16 one
        table = model.vocab_columns.t() if model.vocab_columns is not None else model.embed_tokens.weight
        model.lm_head = _quantized(table, None, bits)  # type: ignore[assignment]
        model.embed_tokens = Bf16Embedding(table)  # type: ignore[assignment]
        model.vocab_columns = None
    elif model.embed_tokens is not None:
        model.embed_tokens = Bf16Embedding(model.embed_tokens.weight)  # type: ignore[assignment]
    return model


class Bf16Embedding(nn.Module):
    """A token embedding stored in bf16 (half the bytes), looked up into float32."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(table.detach().to(torch.bfloat16).contiguous(), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.weight.index_select(0, token_ids).float()  # (T, E)


def _quantized(weight: torch.Tensor, bias: torch.Tensor | None, bits: int) -> QuantizedProjection:
    """int4 where the shape allows it, else int8 (int4 packs 16 output rows and 32-column groups)."""
    out_features, in_features = weight.shape
    if bits == 4 and (in_features % INT4_GROUP or out_features % 16):
        bits = 8
    return QuantizedProjection(weight, bias, bits)


def module_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (packed weights and scales included)."""
    return sum(t.nbytes for t in model.parameters()) + sum(t.nbytes for t in model.buffers())


__all__ = ["QUANTISED_FORMATS", "Bf16Embedding", "QuantizedProjection", "module_bytes", "quantize_model"]
