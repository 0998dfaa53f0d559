"""The int4 decode path in one native call: a Llama/Qwen2 model's layer stack run by int4_decoder.c.

What this module owns: deciding whether a quantised model can run natively (Llama-style blocks,
every projection int4 with output rows in blocks of 64, a bf16 KV cache, a CPU with AVX512-BF16 and
VBMI and a C compiler), describing its weights to the C code once (`Int4Stack.build`), and, per
forward, the index arrays the C code reads (which slots each token writes and reads, which keys it
may see). `DecoderModel.forward` asks `Int4Stack.forward` first; a None answer (a batch of many
tokens, a cache it cannot read) means the torch path runs.

The C code computes each token independently of the others in its batch (see its header), so a
decode step and a verify pass agree exactly; the torch path is kept for prefill chunks of
`MAX_TOKENS` or more, where dense GEMMs win (runtime/quantize.py).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING

import torch

from polylane.runtime.batch import ForwardBatch
from polylane.runtime.kv_cache import PagedKVCache
from polylane.runtime.model_config import GLOBAL
from polylane.runtime.native.build import load_library

if TYPE_CHECKING:
    from polylane.runtime.models.base import DecoderModel
    from polylane.runtime.quantize import QuantizedProjection

# Batches of this many tokens or more run on torch (the quantised projections' dense prefill path):
# the C attention is a loop per token, quadratic in a long prompt (SmolLM2 prefill, tokens/s
# native vs torch: 1,618 vs 641 at 127 tokens, 1,345 vs 740 at 256, 1,034 vs 1,116 at 512).
MAX_TOKENS = 384
# The C attention holds a head's output in registers, 16 floats each.
MAX_HEAD_DIM = 128

_pointer = ctypes.c_void_p


class Int4Matrix(ctypes.Structure):
    _fields_ = [
        ("packed", _pointer),
        ("scales", _pointer),
        ("bias", _pointer),
        ("in_features", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _pointer),
        ("post_norm", _pointer),
        ("qkv", Int4Matrix),
        ("o", Int4Matrix),
        ("gate_up", Int4Matrix),
        ("down", Int4Matrix),
        ("keys", _pointer),
        ("values", _pointer),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("vocab", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(Layer)),
        ("final_norm", _pointer),
        ("lm_head", Int4Matrix),
    ]


class Step(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.c_int64),
        ("rotations", _pointer),
        ("slots", _pointer),
        ("context", _pointer),
        ("context_len", ctypes.c_int64),
        ("sequence", _pointer),
        ("visible", _pointer),
        ("num_logits", ctypes.c_int64),
        ("logit_rows", _pointer),
        ("threads", ctypes.c_int),
    ]


KERNELS = {1: "avx512-bf16", 2: "amx"}


def library() -> ctypes.CDLL | None:
    """The int4 kernels, or None where they cannot run (no compiler, no AVX512-BF16/VBMI)."""
    lib = load_library("int4_decoder")
    if lib is None or not lib.polylane_int4_supported():
        return None
    lib.polylane_int4_forward.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(Step), _pointer, _pointer]
    lib.polylane_int4_forward.restype = ctypes.c_int
    lib.polylane_int4_matmul.argtypes = [
        ctypes.POINTER(Int4Matrix),
        _pointer,
        ctypes.c_int64,
        _pointer,
        ctypes.c_int,
    ]
    lib.polylane_int4_matmul.restype = ctypes.c_int
    lib.polylane_int4_use_amx.argtypes = [ctypes.c_int]
    return lib


def kernel_name() -> str | None:
    """'amx' or 'avx512-bf16': the matrix kernel the native stack runs here; None without one."""
    lib = library()
    return None if lib is None else KERNELS.get(lib.polylane_int4_kernel())


def matmul(projection: QuantizedProjection, x: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 times an int4 projection's weight through the C kernel (tests, benches)."""
    lib = library()
    if lib is None:
        raise RuntimeError("polylane's native int4 kernels are not available on this machine")
    keep: list[torch.Tensor] = []
    matrix = _matrix(projection, keep)
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], projection.out_features)
    threads = torch.get_num_threads()
    if lib.polylane_int4_matmul(ctypes.byref(matrix), x.data_ptr(), x.shape[0], y.data_ptr(), threads):
        raise MemoryError("the native int4 matmul could not allocate its scratch memory")
    return y


def _ineligible_reason(model: DecoderModel) -> str | None:
    from polylane.runtime.quantize import QuantizedProjection

    config = model.config
    if config.architecture not in ("llama", "qwen2"):
        return f"architecture {config.architecture}"
    if config.qk_norm or config.sandwich_norms or config.has_sliding_layers or config.final_logit_softcap:
        return "Gemma-style norms, sliding layers or soft-capping"
    if config.activation != "silu":
        return f"activation {config.activation}"
    if config.head_dim % 16 or config.head_dim > MAX_HEAD_DIM or config.intermediate_size % 16:
        return "head or MLP sizes that are not multiples of 16 (or heads over 128)"
    projections = [model.lm_head]
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        projections += [attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj]
    for projection in projections:
        if not isinstance(projection, QuantizedProjection) or projection.bits != 4:
            return "a projection that is not int4"
        if projection.out_features % 64:
            return "a projection whose output rows are not a multiple of 64"
    return None


def _matrix(projection: QuantizedProjection, keep: list[torch.Tensor]) -> Int4Matrix:
    tensors = [projection.qweight.contiguous(), projection.scales.contiguous()]
    if projection.bias is not None:
        tensors.append(projection.bias.detach().contiguous())
    keep.extend(tensors)
    return Int4Matrix(
        tensors[0].data_ptr(),
        tensors[1].data_ptr(),
        tensors[2].data_ptr() if len(tensors) > 2 else None,
        projection.in_features,
        projection.out_features,
    )


class Int4Stack:
    """A quantised model's weights as the C code reads them, and the call that runs them."""

    def __init__(self, lib: ctypes.CDLL, model: DecoderModel) -> None:
        config = model.config
        self._lib = lib
        self._keep: list[torch.Tensor] = []  # every tensor the C structures point into
        layers = (Layer * config.num_layers)()
        for index, block in enumerate(model.layers):
            norms = [block.input_layernorm.weight.detach(), block.post_attention_layernorm.weight.detach()]
            self._keep.extend(norms)
            layers[index].input_norm = norms[0].data_ptr()
            layers[index].post_norm = norms[1].data_ptr()
            layers[index].qkv = _matrix(block.self_attn.qkv_proj, self._keep)
            layers[index].o = _matrix(block.self_attn.o_proj, self._keep)
            layers[index].gate_up = _matrix(block.mlp.gate_up_proj, self._keep)
            layers[index].down = _matrix(block.mlp.down_proj, self._keep)
        final_norm = model.norm.weight.detach()
        self._keep.append(final_norm)
        self._layers = layers
        self._model = Model(
            num_layers=config.num_layers,
            hidden=config.hidden_size,
            heads=config.num_heads,
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            vocab=model.lm_head.out_features,
            eps=config.rms_norm_eps,
            scale=config.attention_scale or config.head_dim**-0.5,
            layers=layers,
            final_norm=final_norm.data_ptr(),
            lm_head=_matrix(model.lm_head, self._keep),
        )
        self._bound_cache: weakref.ref[PagedKVCache] | None = None

    @classmethod
    def build(cls, model: DecoderModel) -> Int4Stack | None:
        """The native stack of a quantised model, or None where it cannot run (see module doc)."""
        if _ineligible_reason(model) is not None or model.norm.weight.device.type != "cpu":
            return None
        lib = library()
        return None if lib is None else cls(lib, model)

    def _bind(self, cache: PagedKVCache) -> None:
        if self._bound_cache is not None and self._bound_cache() is cache:
            return
        for index in range(len(self._layers)):
            self._layers[index].keys = cache.keys[index].data_ptr()
            self._layers[index].values = cache.values[index].data_ptr()
        self._bound_cache = weakref.ref(cache)

    def forward(self, model: DecoderModel, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor | None:
        """Logits (R, vocab) of the batch's logit rows with its K/V written, or None when this
        batch is for the torch path (too many tokens, boundary states to record, a cache that is
        not bf16 on the CPU: `LoadedModel.kv_dtype`)."""
        tokens = batch.token_ids.shape[0]
        if tokens >= MAX_TOKENS or cache.boundary_states or cache.dtype != torch.bfloat16:
            return None
        if cache.keys[0].device.type != "cpu":
            return None
        self._bind(cache)
        hidden = model.embed(batch.token_ids).float().contiguous()  # (T, E)
        rotations = torch.view_as_real(model._rotary[GLOBAL].lookup(batch.positions)).contiguous()
        context, sequence, visible = _attention_rows(batch, tokens)
        logit_rows = batch.logit_rows.contiguous()
        logits = torch.empty(logit_rows.shape[0], self._model.vocab, dtype=torch.float32)
        step = Step(
            tokens=tokens,
            rotations=rotations.data_ptr(),
            slots=batch.slot_mapping.contiguous().data_ptr(),
            context=context.data_ptr(),
            context_len=context.shape[1],
            sequence=sequence.data_ptr(),
            visible=visible.data_ptr(),
            num_logits=logit_rows.shape[0],
            logit_rows=logit_rows.data_ptr(),
            threads=torch.get_num_threads(),
        )
        status = self._lib.polylane_int4_forward(
            ctypes.byref(self._model), ctypes.byref(step), hidden.data_ptr(), logits.data_ptr()
        )
        if status != 0:
            raise MemoryError("the native int4 forward could not allocate its scratch memory")
        return logits


def _attention_rows(batch: ForwardBatch, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per forward: (B, C) slots each sequence reads, (T,) sequence of each token, and (T, C)
    bool keys each token may see, from the batch's global-attention layout."""
    layout = batch.layouts[GLOBAL]
    if layout.kv_range is not None:
        start, stop = layout.kv_range
        context = torch.arange(start, stop, dtype=torch.long).view(1, -1)
    elif layout.kv_index is not None:
        context = layout.kv_index.view(layout.batch_size, -1)
    else:  # a fresh prefill reads its own new K/V, written before attention runs
        context = batch.slot_mapping.view(1, -1)
    width = context.shape[1]
    if layout.mask is None:
        if layout.is_causal:
            visible = torch.ones(tokens, width, dtype=torch.bool).tril()
        else:
            visible = torch.ones(tokens, width, dtype=torch.bool)
        sequence = torch.zeros(tokens, dtype=torch.long)
    else:
        rows = layout.mask.reshape(-1, width)  # (B * Q, C)
        if layout.out_index is None:
            visible, sequence = rows, torch.zeros(tokens, dtype=torch.long)
        else:
            queries = rows.shape[0] // layout.batch_size
            visible, sequence = rows.index_select(0, layout.out_index), layout.out_index // queries
    return context.contiguous(), sequence.contiguous(), visible.contiguous()
