"""Layers shared by every architecture: RMSNorm, rotary embeddings, paged attention, gated MLP.

Tensors are flat over the batch: T new tokens from any number of sequences, hidden states (T, E).
Attention goes through the paged KV cache and the `AttentionLayout` of `runtime.model.batch`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from polylane.runtime.kv.kv_cache import PagedKVCache
from polylane.runtime.model.batch import AttentionLayout, ForwardBatch
from polylane.runtime.model.model_config import GLOBAL, SLIDING, ModelConfig


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, normalised in float32.

    The weight is multiplicative as stored here: Gemma's `1 + w` convention is folded in at load.
    `cast_before_weight`: Llama/Qwen cast the normalised x back to the input dtype before the
    multiply; Gemma multiplies in float32 and casts after. Both follow their reference.
    """

    def __init__(self, size: int, eps: float, cast_before_weight: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps
        self.cast_before_weight = cast_before_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused kernel, the same float32 arithmetic as below (both conventions agree here)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cast_before_weight:
            return self.weight * normed.to(dtype)
        return (normed * self.weight.float()).to(dtype)


class RotaryTable:
    """RoPE rotations for one base as unit complex numbers, grown on demand, indexed by position.

    Q and K are stored with each head's rotary pairs interleaved — (x0, x_{D/2}), (x1,
    x_{D/2+1}), … — so a rotation is one complex multiply (the loader permutes Q/K rows into
    that order; attention scores do not change, since Q and K are permuted alike).
    """

    def __init__(self, head_dim: int, theta: float, device: torch.device) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        self.inv_freq = 1.0 / (theta**exponents)
        self.rotations = torch.empty(0, head_dim // 2, dtype=torch.complex64, device=device)

    def table(self, needed: int) -> torch.Tensor:
        """(P, head_dim / 2) complex rotations of positions 0 .. P - 1, P >= `needed` (grown on
        demand, at least doubling)."""
        if needed > self.rotations.shape[0]:
            size = max(needed, 2 * self.rotations.shape[0], 256)
            steps = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
            angles = steps[:, None] * self.inv_freq[None, :]  # (P, D/2)
            self.rotations = torch.polar(torch.ones_like(angles), angles)
        return self.rotations

    def lookup(self, positions: torch.Tensor, bound: int) -> torch.Tensor:
        """(T,) positions, each below `bound` → (T, 1, head_dim / 2) complex rotations (the bound
        comes from the host: reading the largest position off a device would wait for it)."""
        return self.table(bound)[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """x (T, n, D), pairs interleaved, rotated by (T, 1, D/2) complex rotations (float32 math)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # (T, n, D/2)
    return torch.view_as_real(pairs * rotations).flatten(-2).to(x.dtype)


def interleave_rotary_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of Q/K (num_heads * D, …) from rotate-half order into interleaved pairs."""
    head_dim = tensor.shape[0] // num_heads
    grouped = tensor.reshape(num_heads, 2, head_dim // 2, *tensor.shape[1:])
    return grouped.transpose(1, 2).reshape(tensor.shape)


def _cpu_has_bf16_matrix_units() -> bool:
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


# On CPUs without bf16 matrix instructions (AVX2-only x86, e.g. the AMD EPYC machines we develop
# on), a bf16 GEMM runs 4-6x slower than a float32 one; from this many rows on, converting the
# weight to float32 costs less than it saves (measured: 8 rows 1.5x faster, 512 rows 6.5x).
BF16_UPCAST_MIN_ROWS = 8
_UPCAST_BF16 = not _cpu_has_bf16_matrix_units()


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, input_major: bool
) -> torch.Tensor:
    """x (M, K) times a weight stored (K, N) when `input_major`, else (N, K); plus bias."""
    if input_major:
        return x @ weight if bias is None else torch.addmm(bias, x, weight)
    if (
        _UPCAST_BF16
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and x.shape[0] >= BF16_UPCAST_MIN_ROWS
    ):
        bias32 = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), bias32).to(x.dtype)
    return F.linear(x, weight, bias)


class Projection(nn.Module):
    """A linear layer whose weight layout is chosen for the kernel that runs it fastest.

    Weights come in the (out, in) layout of the files; widening float32 weights are stored
    transposed, (in, out) (`use_input_major_layout`, chosen before loading): on CPU, MKL's one-row
    matmul streams that layout up to 1.6x faster (measured on SmolLM2's shapes), and one-row
    matmuls are the whole of batch-1 decode.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.input_major = False

    @property
    def prefers_input_major(self) -> bool:
        """(in, out) pays for widening and square matrices; narrowing ones (the MLP's down
        projection) ran 1.4x faster in (out, in) (measured, SmolLM2 shapes, one row)."""
        out_features, in_features = self.weight.shape
        return out_features >= in_features

    def use_input_major_layout(self) -> None:
        """Store the weight (in, out) from now on (called before loading, on the meta device)."""
        out_features, in_features = self.weight.shape
        empty = torch.empty(in_features, out_features, device=self.weight.device)
        self.weight = nn.Parameter(empty, requires_grad=False)
        self.input_major = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.input_major)


class ForwardContext:
    """Per-forward state every layer reads: the batch layout, RoPE angles and the KV cache."""

    def __init__(
        self,
        batch: ForwardBatch,
        kv_cache: PagedKVCache,
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        self.batch = batch
        self.kv_cache = kv_cache
        self.rotary = rotary  # layer type → (cos, sin) for this batch's positions


class PagedAttention(nn.Module):
    """Grouped-query self-attention with fused QKV, over the paged KV cache."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.layer_type = config.layer_types[layer_index]
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale or config.head_dim**-0.5
        qkv_size = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = Projection(config.hidden_size, qkv_size, bias=config.qkv_bias)
        self.o_proj = Projection(config.num_heads * config.head_dim, config.hidden_size)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, cast_before_weight=False)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, cast_before_weight=False)

    def forward(self, hidden: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        tokens = hidden.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)  # (T, (H + 2 Hkv) D)
        qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
        rotations = context.rotary[self.layer_type]
        if self.q_norm is not None:
            q = apply_rotary(self.q_norm(qk[:, :heads]), rotations)  # (T, H, D)
            k = apply_rotary(self.k_norm(qk[:, heads:]), rotations)  # (T, Hkv, D)
        else:
            qk = apply_rotary(qk, rotations)
            q, k = qk[:, :heads], qk[:, heads:]
        cache = context.kv_cache
        cache.write(self.layer_index, context.batch.slot_mapping, k, v)
        layout = context.batch.layouts[self.layer_type if self.layer_type == SLIDING else GLOBAL]
        out = paged_attention(q, k, v, cache, self.layer_index, layout, self.scale)
        return self.o_proj(out.reshape(tokens, heads * head_dim))


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    layout: AttentionLayout,
    scale: float,
) -> torch.Tensor:
    """q (T, H, D) attends per `layout`; returns (T, H, D)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_new.shape[1]
    batch, context = layout.batch_size, layout.context_len
    if layout.kv_range is not None:
        start, stop = layout.kv_range
        keys, values = cache.keys[layer][start:stop], cache.values[layer][start:stop]
    elif layout.kv_index is not None:
        keys = cache.keys[layer].index_select(0, layout.kv_index)
        values = cache.values[layer].index_select(0, layout.kv_index)
    else:  # fresh prefill: the chunk's own K/V are the whole context
        keys, values = k_new, v_new
    keys = keys.view(batch, context, num_kv_heads, head_dim).transpose(1, 2)  # (B, Hkv, C, D)
    values = values.view(batch, context, num_kv_heads, head_dim).transpose(1, 2)
    queries = q if layout.query_index is None else q[layout.query_index]  # (B·Q, H, D)
    if q.shape[0] == batch:
        # One query per sequence: fold each KV head's query group into the query axis, so
        # grouped-query attention needs no repeated K/V. (B, Hkv, G, D)
        # Plain matmuls: SDPA's CPU flash kernel took 170-250 us per call here for a few query rows.
        # In float32: bf16 batched matmuls are several times slower on CPUs without bf16 units.
        grouped = queries.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.matmul(grouped.float(), keys.float().transpose(-1, -2)) * scale  # (B, Hkv, G, C)
        if layout.mask is not None:
            scores = scores.masked_fill(~layout.mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), values.float())  # (B, Hkv, G, D)
        return out.reshape(batch, num_heads, head_dim).to(q.dtype)
    queries = queries.view(batch, -1, num_heads, head_dim).transpose(1, 2)  # (B, H, Q, D)
    out = F.scaled_dot_product_attention(
        queries,
        keys.to(queries.dtype),  # a bf16 cache under float32 activations (int4 models)
        values.to(queries.dtype),
        attn_mask=layout.mask,
        is_causal=layout.is_causal,
        scale=scale,
        enable_gqa=True,
    ).transpose(1, 2)  # (B, Q, H, D)
    if layout.out_index is None:
        return out[0]
    return out.reshape(-1, num_heads, head_dim)[layout.out_index]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matrix."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Projection(hidden_size, 2 * intermediate_size)
        self.down_proj = Projection(intermediate_size, hidden_size)
        if activation == "silu":
            self.act = F.silu
        elif activation == "gelu_tanh":
            self.act = lambda x: F.gelu(x, approximate="tanh")
        else:
            raise ValueError(f"unknown activation {activation!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)
