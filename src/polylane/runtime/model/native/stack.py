"""A Llama/Qwen2/Gemma 3 model's whole layer stack in one native call (decoder.c), and when it runs.

What this module owns: deciding whether a loaded model can run natively (Llama-style or Gemma 3
blocks and a C compiler; projections a GGUF file's own blocks in place (`runtime.model.block_weights`,
any row count) on every CPU, or int4, int8, bf16 or float32 with output rows in blocks of 64 on a
CPU with AVX512-BF16 and VBMI, whose dense kernels they need), describing its weights to the C
code once (`NativeStack.build`, called by `load_model`), and, per forward, the index arrays the C
code reads (which slots each token writes and reads, which keys it may see, in sliding layers
too). `DecoderModel.forward` asks `NativeStack.forward` first; a None answer (a batch of many
tokens, a cache off the CPU) means the torch path runs. Boundary states (the hidden state entering
a layer that a peer model shares up to) are recorded as torch records them.

The C code computes each token independently of the others in its batch (see its header), so a
decode step and a verify pass agree exactly; a prompt chunk of 16+ tokens takes the AMX prompt
paths by its own length, whatever shares its step. Forwards of more tokens than `max_tokens` go
to torch, whose dense GEMMs win there, and so do int8 forwards with `max_exact_tokens` or more
tokens outside prompt runs; where a step is that large only because of prompt runs of
`max_tokens` or more (a CPU without AMX), `split` sends those runs to torch and keeps the rest of
the step here, so decode and verify tokens keep their exact path beside long prompts. int4 weights
run here only in the packing decoder.c reads (`int4_packing_problem`).
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from polylane.runtime.kv.kv_cache import PagedKVCache
from polylane.runtime.model.batch import ForwardBatch, new_token_visibility
from polylane.runtime.model.block_weights import BlockEmbedding, BlockMatrix, BlockProjection, Segment
from polylane.runtime.model.int4_layout import packing_layout
from polylane.runtime.model.layers import Projection
from polylane.runtime.model.model_config import GLOBAL, SLIDING, ModelConfig
from polylane.runtime.model.native import abi
from polylane.runtime.model.native.build import load_library
from polylane.runtime.model.quantize import QuantizedProjection
from polylane.runtime.models import ARCHITECTURES
from polylane.types import SequenceChunk

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from polylane.runtime.models.base import DecoderModel

# Batches of this many tokens or more run on torch, by the weights' kind (the smallest over a
# model's projections): from there torch wins (SmolLM2 prefill, tokens/s native vs torch). int4:
# prompts attend on AMX tiles, so native stays ahead at every size measured — 3,742 vs 881 at 511
# tokens, 2,954 vs 1,123 at 1,024, 2,034 vs 1,006 at 2,048 (`bench/native_step.py --prefill 511 1024
# 2048`); the cap bounds the per-forward scratch (T × 2I floats, ~50 MB at 4,096 tokens). bf16:
# 1,656 vs 1,295 at 64, 1,670 vs 1,817 at 127 (`python bench/native_step.py --dtype bf16 --prefill
# 64 127`, oneDNN's AMX GEMMs). int8: prompt runs on tiles as int4's. float32 has no matrix unit:
# from a few rows MKL's GEMMs win.
INT4, BF16, FP32, FP32_INPUT_MAJOR, INT8, BLOCKS = 0, 1, 2, 3, 4, 5
# GGUF blocks in place (dtype auto): torch's path multiplies with the same block kernels, so the
# native stack (its attention and the rest in C, one call) is ahead at every size.
MAX_TOKENS = {INT4: 4096, BF16: 96, INT8: 4096, FP32: 8, FP32_INPUT_MAJOR: 8, BLOCKS: 4096}
# Without AMX (AVX512-BF16 dot products, no tile attention) int4 prompts gain nothing from ~128
# tokens on: 585 vs 587 tokens/s at 127, 505 vs 881 at 511 (the same command's avx512-bf16 column);
# int8 against torch's bf16 GEMMs of the codes (`quantize.INT8_GEMM_MIN_ROWS`): 456 vs 381 at 24,
# 470 vs 564 at 32 (`--dtype int8 --prefill 16 24 32 47`).
MAX_TOKENS_WITHOUT_AMX = {**MAX_TOKENS, INT4: 128, INT8: 32}
# int8's rows outside prompt runs (decode and verify tokens) take the dot products, which torch's
# bf16 GEMMs of the codes overtake at about this many (`--dtype int8 --batch 32 40 48 64`, ms per
# step native vs torch: 65.8 vs 81.1 at 32, 85.5 vs 90.0 at 40, 102.8 vs 95.4 at 48).
MAX_EXACT_INT8_TOKENS = 44
# A chunk of this many tokens or more asking for at most one row's logits is a prompt run
# (decoder.c RUN_ROWS).
RUN_ROWS = 16
# The C attention sums a head's output in registers, 16 floats each, 128 dims at a time.
MAX_HEAD_DIM = 256
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}

DENSE_KERNELS_NEED = "the dense kernels need AVX512-BF16 and AVX512-VBMI"

_pointer = ctypes.c_void_p


class Matrix(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("weight", _pointer),
        ("scales", _pointer),
        ("bias", _pointer),
        ("in_features", ctypes.c_int64),
        ("out_features", ctypes.c_int64),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _pointer),
        ("post_norm", _pointer),
        ("qkv", Matrix),
        ("o", Matrix),
        ("gate_up", Matrix),
        ("down", Matrix),
        ("keys", _pointer),
        ("values", _pointer),
        ("boundary", _pointer),
        ("boundary_valid", _pointer),
        ("q_norm", _pointer),
        ("k_norm", _pointer),
        ("attention_norm", _pointer),
        ("mlp_norm", _pointer),
        ("sliding", ctypes.c_int64),
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
        ("kv_bf16", ctypes.c_int64),
        ("layers", ctypes.POINTER(Layer)),
        ("final_norm", _pointer),
        ("lm_head", Matrix),
        ("embedding", Matrix),
        ("embedding_scale", ctypes.c_float),
        ("final_boundary", _pointer),
        ("final_boundary_valid", _pointer),
        ("activation", ctypes.c_int64),
    ]


class Step(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.c_int64),
        ("token_ids", _pointer),
        ("positions", _pointer),
        ("rotations", _pointer),
        ("slots", _pointer),
        ("context", _pointer),
        ("context_len", ctypes.c_int64),
        ("sequence", _pointer),
        ("visible", _pointer),
        ("num_logits", ctypes.c_int64),
        ("logit_rows", _pointer),
        ("threads", ctypes.c_int),
        ("start_layer", ctypes.c_int64),
        ("input", _pointer),
        ("local_rotations", _pointer),
        ("local_visible", _pointer),
    ]


KERNELS = {1: "avx512-bf16", 2: "amx"}


def library() -> ctypes.CDLL | None:
    """The native stack's library, or None where it cannot run (no compiler, kernels turned off)."""
    lib = load_library("decoder")
    if lib is None:
        return None
    if not getattr(lib, "_polylane_abi_checked", False):
        check_abi(lib)
        lib._polylane_abi_checked = True
    lib.polylane_forward.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(Step), _pointer]
    lib.polylane_forward.restype = ctypes.c_int
    lib.polylane_matmul.argtypes = [
        ctypes.POINTER(Matrix),
        _pointer,
        ctypes.c_int64,
        _pointer,
        ctypes.c_int,
        ctypes.c_int,
    ]
    lib.polylane_matmul.restype = ctypes.c_int
    lib.polylane_use_amx.argtypes = [ctypes.c_int]
    return lib


def check_abi(lib: ctypes.CDLL) -> None:
    """NativeAbiError unless the decoder library's structs are laid out as this module's (and
    block_weights') ctypes mirrors: a mismatch would corrupt memory silently."""
    abi.check(lib, "decoder", "polylane_blocks_abi", [Segment, BlockMatrix])
    abi.check(lib, "decoder", "polylane_stack_abi", [Matrix, Layer, Model, Step])


def kernel_name() -> str | None:
    """'amx' or 'avx512-bf16': the kernel the native stack multiplies dense weights (int4, int8, bf16,
    float32) with here; None where it has none (no AVX512-BF16/VBMI: GGUF blocks only)."""
    lib = library()
    return None if lib is None else KERNELS.get(lib.polylane_kernel())


def runs_natively(config: ModelConfig) -> bool:
    """Whether a CPU model of this shape gets the native stack here (before it is loaded; a
    projection no kernel takes can still send a loaded one to torch)."""
    return _config_reason(config) is None and library() is not None


def _config_reason(config: ModelConfig) -> str | None:
    architecture = ARCHITECTURES.get(config.architecture)
    if architecture is None or not architecture[1].NATIVE_STACK:
        return f"architecture {config.architecture}"
    if config.activation not in ACTIVATIONS:
        return f"activation {config.activation}"
    if config.head_dim % 16 or config.head_dim > MAX_HEAD_DIM or config.intermediate_size % 16:
        return f"head or MLP sizes that are not multiples of 16 (or heads over {MAX_HEAD_DIM})"
    return None


def _weight_matrix(weight: torch.Tensor, bias: torch.Tensor | None, input_major: bool, keep: list) -> Matrix:
    """A dense weight as the C code reads it: bf16 or float32 (N, K), or float32 (K, N)."""
    if weight.dtype == torch.bfloat16 and not input_major:
        kind = BF16
    elif weight.dtype == torch.float32:
        kind = FP32_INPUT_MAJOR if input_major else FP32
    else:
        raise ValueError(
            f"no native kernel for {weight.dtype} weights{' stored (in, out)' if input_major else ''}"
        )
    in_features, out_features = weight.shape if input_major else weight.shape[::-1]
    return _described(kind, weight.detach().contiguous(), None, bias, in_features, out_features, keep)


def _described(kind, weight, scales, bias, in_features, out_features, keep: list) -> Matrix:
    if out_features % 64 or in_features % 32:
        raise ValueError(f"a {out_features}×{in_features} projection is not in blocks of 64 rows, 32 columns")
    bias32 = None if bias is None else bias.detach().float().contiguous()
    keep.extend(t for t in (weight, scales, bias32) if t is not None)
    return Matrix(
        kind,
        weight.data_ptr(),
        None if scales is None else scales.data_ptr(),
        None if bias32 is None else bias32.data_ptr(),
        in_features,
        out_features,
    )


def describe(projection: nn.Module, keep: list[torch.Tensor]) -> Matrix:
    """Any projection of a model (int4, int8, bf16 or float32) as the C code reads it; `keep` collects
    the tensors the description points into. ValueError where no native kernel fits."""
    if isinstance(projection, BlockProjection | BlockEmbedding):
        return _blocks_matrix(projection)
    if kernel_name() is None:
        raise ValueError(f"no native kernel for {type(projection).__name__} here: {DENSE_KERNELS_NEED}")
    if isinstance(projection, QuantizedProjection):
        qweight, bias = projection.qweight.contiguous(), projection.bias
        if projection.bits == 8:  # (N, K) int8 and a float32 scale per output row
            kind, scales = INT8, projection.scales.float().contiguous()
        else:
            if (problem := int4_packing_problem()) is not None:
                raise ValueError(problem)
            kind, scales = INT4, projection.scales.contiguous()
        return _described(kind, qweight, scales, bias, projection.in_features, projection.out_features, keep)
    if isinstance(projection, Projection):
        return _weight_matrix(projection.weight, projection.bias, projection.input_major, keep)
    raise ValueError(f"no native kernel for {type(projection).__name__}")


# The int4 packing decoder.c reads: torch's AVX512 layout, 64-row blocks whose byte j of a column
# holds row j (low nibble) and row j + 32 (high nibble).
C_INT4_ROW_AT = tuple(row for j in range(32) for row in (j, j + 32))


def int4_packing_problem() -> str | None:
    """Why int4 weights packed by this process's torch cannot go to decoder.c (torch packs another
    layout where its kernels were dispatched for AVX2 or none, `runtime.model.int4_layout`), or None."""
    layout = packing_layout()
    if layout is not None and layout.block_rows == 64 and layout.row_at == C_INT4_ROW_AT:
        return None
    found = "an unknown layout" if layout is None else f"the {layout.name} layout"
    return f"torch packs int4 weights in {found} here; the native kernels read AVX512's"


def matmul(projection: nn.Module, x: torch.Tensor, prompt: bool = False) -> torch.Tensor:
    """x (M, K) float32 times a projection's weight (plus bias) through the C kernels (tests,
    benches); `prompt`: the rows are one prompt run (RUN_ROWS), which on AMX multiplies an
    int4 weight rounded to bf16."""
    lib = library()
    if lib is None:
        raise RuntimeError("polylane's native kernels are not available on this machine")
    keep: list[torch.Tensor] = []
    matrix = describe(projection, keep)
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], matrix.out_features)
    threads = torch.get_num_threads()
    rows = x.shape[0]
    if lib.polylane_matmul(ctypes.byref(matrix), x.data_ptr(), rows, y.data_ptr(), threads, int(prompt)):
        raise MemoryError("the native matmul could not allocate its scratch memory")
    return y


def _blocks_matrix(module: BlockProjection | BlockEmbedding) -> Matrix:
    """A GGUF file's tensors in place (`runtime.model.block_weights`): the C code reads the module's own
    description (its segments and bias), which lives as long as the model."""
    described = module.matrix()
    return Matrix(
        BLOCKS, ctypes.addressof(described), None, None, described.in_features, described.out_features
    )


def _embedding_matrix(model: DecoderModel, keep: list[torch.Tensor]) -> Matrix:
    """The token embedding as the C code looks rows up in it: float32 or bf16 (vocab, hidden), the
    tied float32 columns (hidden, vocab), or a GGUF tensor's blocks."""
    if isinstance(model.embed_tokens, BlockEmbedding):
        return _blocks_matrix(model.embed_tokens)
    if kernel_name() is None:  # (a tied table is also the output matrix: dense kernels)
        raise ValueError(f"no native kernel for a dense embedding here: {DENSE_KERNELS_NEED}")
    if model.vocab_columns is not None:
        return _weight_matrix(model.vocab_columns, None, True, keep)
    return _weight_matrix(model.embed_tokens.weight, None, False, keep)


def _output_matrix(model: DecoderModel, keep: list[torch.Tensor]) -> Matrix:
    if model.lm_head is not None:
        return describe(model.lm_head, keep)
    return _embedding_matrix(model, keep)  # tied: the same table, read as (vocab, hidden) rows


class NativeStack:
    """A model's weights as the C code reads them, and the call that runs them."""

    def __init__(self, lib: ctypes.CDLL, model: DecoderModel) -> None:
        config = model.config
        self._lib = lib
        self._keep: list[torch.Tensor] = []  # every tensor the C structures point into
        layers = (Layer * config.num_layers)()
        kinds = set()
        for index, block in enumerate(model.layers):
            layers[index].input_norm = self._norm(block.input_layernorm)
            if config.sandwich_norms:  # Gemma: norms on the attention's and MLP's outputs too
                layers[index].post_norm = self._norm(block.pre_feedforward_layernorm)
                layers[index].attention_norm = self._norm(block.post_attention_layernorm)
                layers[index].mlp_norm = self._norm(block.post_feedforward_layernorm)
            else:
                layers[index].post_norm = self._norm(block.post_attention_layernorm)
            if config.qk_norm:
                layers[index].q_norm = self._norm(block.self_attn.q_norm)
                layers[index].k_norm = self._norm(block.self_attn.k_norm)
            layers[index].sliding = int(config.layer_types[index] == SLIDING)
            layers[index].qkv = describe(block.self_attn.qkv_proj, self._keep)
            layers[index].o = describe(block.self_attn.o_proj, self._keep)
            layers[index].gate_up = describe(block.mlp.gate_up_proj, self._keep)
            layers[index].down = describe(block.mlp.down_proj, self._keep)
            kinds |= {
                layers[index].qkv.kind,
                layers[index].o.kind,
                layers[index].gate_up.kind,
                layers[index].down.kind,
            }
        lm_head = _output_matrix(model, self._keep)
        kinds.add(lm_head.kind)
        limits = MAX_TOKENS if kernel_name() == "amx" else MAX_TOKENS_WITHOUT_AMX
        self.max_tokens = min(limits[kind] for kind in kinds)
        self.max_exact_tokens = MAX_EXACT_INT8_TOKENS if INT8 in kinds else None
        self._layers = layers
        self._model = Model(
            num_layers=config.num_layers,
            hidden=config.hidden_size,
            heads=config.num_heads,
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            vocab=lm_head.out_features,
            eps=config.rms_norm_eps,
            scale=config.attention_scale or config.head_dim**-0.5,
            kv_bf16=0,
            layers=layers,
            final_norm=self._norm(model.norm),
            lm_head=lm_head,
            embedding=_embedding_matrix(model, self._keep),
            embedding_scale=config.embedding_scale,
            activation=ACTIVATIONS[config.activation],
        )
        self._bound_cache: weakref.ref[PagedKVCache] | None = None
        self._bound_boundaries: tuple[int, ...] = ()

    def _norm(self, norm: nn.Module) -> int:
        """The address of a norm's float32 weight (kept alive with the stack)."""
        weight = norm.weight.detach().float().contiguous()
        self._keep.append(weight)
        return weight.data_ptr()

    @classmethod
    def build(cls, model: DecoderModel) -> NativeStack | None:
        """The native stack of a loaded model, or None where it cannot run (see module doc)."""
        if _config_reason(model.config) is not None or model.norm.weight.device.type != "cpu":
            return None
        lib = library()
        if lib is None:
            return None
        try:
            return cls(lib, model)
        except ValueError as error:  # a projection no kernel takes (odd shapes, packing): torch runs it
            log.info(
                "the native stack does not run this %s model, torch does: %s",
                model.config.architecture,
                error,
            )
            return None

    def _bind(self, cache: PagedKVCache) -> None:
        boundaries = tuple(sorted(cache.boundary_states))  # (a peer may add one while bound)
        bound = self._bound_cache is not None and self._bound_cache() is cache
        if bound and self._bound_boundaries == boundaries:
            return
        for index in range(len(self._layers)):
            self._layers[index].keys = cache.keys[index].data_ptr()
            self._layers[index].values = cache.values[index].data_ptr()
            self._layers[index].boundary, self._layers[index].boundary_valid = _boundary(cache, index)
        self._model.final_boundary, self._model.final_boundary_valid = _boundary(cache, len(self._layers))
        self._bound_boundaries = boundaries
        self._model.kv_bf16 = int(cache.dtype == torch.bfloat16)
        self._bound_cache = weakref.ref(cache)

    def split(self, batch: ForwardBatch) -> tuple[list[int], list[int]] | None:
        """For a batch `forward` hands to torch as a whole: (chunks for the native stack, chunks for
        torch) such that each prompt run's path depends on its own length alone and every other
        token stays on the native stack — so a decode token or a verify pass gives the logits it
        gives alone even beside a long prompt (on a CPU without AMX, prompt runs of `max_tokens`
        or more take torch's GEMMs). None: no such split (every chunk is such a run, or the rest
        is still too many tokens for the native stack)."""
        long_runs = [
            i for i, c in enumerate(batch.chunks) if _is_prompt_run(c) and c.num_new >= self.max_tokens
        ]
        rest = [i for i in range(len(batch.chunks)) if i not in long_runs]
        if not long_runs or not rest:
            return None
        if sum(batch.chunks[i].num_new for i in rest) >= self.max_tokens:
            return None
        exact = sum(batch.chunks[i].num_new for i in rest if not _is_prompt_run(batch.chunks[i]))
        if self.max_exact_tokens is not None and exact >= self.max_exact_tokens:
            return None
        return rest, long_runs

    def forward(
        self,
        model: DecoderModel,
        batch: ForwardBatch,
        cache: PagedKVCache,
        start_layer: int = 0,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Logits (R, vocab) of the batch's logit rows with its K/V written, or None when this
        batch is for the torch path (`max_tokens` or more tokens, int8 with `max_exact_tokens` or
        more outside prompt runs, a cache off the CPU or neither bf16 nor float32). With
        `start_layer` > 0, `hidden` (T, E) is that layer's input and the layers below are not run
        (a shared band's continuation, `DecoderModel.forward`)."""
        tokens = batch.token_ids.shape[0]
        if tokens >= self.max_tokens or cache.dtype not in (torch.bfloat16, torch.float32):
            return None
        if self.max_exact_tokens is not None and _exact_tokens(batch) >= self.max_exact_tokens:
            return None
        if cache.keys[0].device.type != "cpu":
            return None
        self._bind(cache)
        if hidden is not None:
            hidden = hidden.to(torch.float32).contiguous()  # (boundary states may be kept in bf16)
        rotations = model._rotary[GLOBAL].table(batch.longest_context)
        local_rotations = model._rotary.get(SLIDING, model._rotary[GLOBAL]).table(batch.longest_context)
        context, sequence, visible = _attention_rows(batch)
        local_visible = visible
        if model.config.has_sliding_layers:
            local_visible = _window(batch, visible, model.config.sliding_window)
        logits = torch.empty(batch.logit_rows.shape[0], self._model.vocab, dtype=torch.float32)
        step = Step(
            tokens=tokens,
            token_ids=batch.token_ids.data_ptr(),
            positions=batch.positions.data_ptr(),
            rotations=rotations.data_ptr(),
            slots=batch.slot_mapping.data_ptr(),
            context=context.ctypes.data,
            context_len=context.shape[1],
            sequence=sequence.ctypes.data,
            visible=visible.ctypes.data,
            num_logits=batch.logit_rows.shape[0],
            logit_rows=batch.logit_rows.data_ptr(),
            threads=torch.get_num_threads(),
            start_layer=start_layer,
            input=None if hidden is None else hidden.data_ptr(),
            local_rotations=local_rotations.data_ptr(),
            local_visible=local_visible.ctypes.data,
        )
        if self._lib.polylane_forward(ctypes.byref(self._model), ctypes.byref(step), logits.data_ptr()) != 0:
            raise MemoryError("the native forward could not allocate its scratch memory")
        if model.config.final_logit_softcap:
            cap = model.config.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits


def _attention_rows(batch: ForwardBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per forward: (B, C) slots each sequence reads (a shorter context padded with its first
    slot), (T,) sequence of each token, and (T, C) bool keys each token may see (its committed
    prefix, and its chunk's new tokens causally or as tree ancestors)."""
    slots, chunks = batch.context_slots, batch.chunks
    width = max(len(row) for row in slots)
    tokens = sum(c.num_new for c in chunks)
    context = np.empty((len(chunks), width), dtype=np.int64)
    sequence = np.empty(tokens, dtype=np.int64)
    visible = np.zeros((tokens, width), dtype=bool)
    start = 0
    for b, (chunk, row) in enumerate(zip(chunks, slots, strict=True)):
        context[b, : len(row)] = row
        context[b, len(row) :] = row[0]
        end = start + chunk.num_new
        sequence[start:end] = b
        visible[start:end, : chunk.num_cached] = True
        visible[start:end, chunk.num_cached : chunk.context_len] = new_token_visibility(chunk)
        start = end
    return context, sequence, visible


def _is_prompt_run(chunk: SequenceChunk) -> bool:
    """decoder.c `find_runs`: a chunk of RUN_ROWS tokens or more with at most one logit row."""
    return chunk.num_new >= RUN_ROWS and chunk.logits != "all"


def _exact_tokens(batch: ForwardBatch) -> int:
    """The batch's tokens outside prompt runs."""
    return sum(c.num_new for c in batch.chunks if not _is_prompt_run(c))


def _window(batch: ForwardBatch, visible: np.ndarray, window: int) -> np.ndarray:
    """`visible` (T, C) narrowed to the keys a sliding layer sees: query position minus key position
    below `window` (a committed key's position is its index in the context, a new key's that of
    its token: tree branches share positions)."""
    if batch.longest_context <= window:
        return visible
    positions = np.asarray(batch.host_positions, dtype=np.int64)
    key_positions = np.broadcast_to(np.arange(visible.shape[1], dtype=np.int64), visible.shape).copy()
    start = 0
    for chunk in batch.chunks:
        end = start + chunk.num_new
        key_positions[start:end, chunk.num_cached : chunk.context_len] = positions[start:end]
        start = end
    return visible & (positions[:, None] - key_positions < window)


def _boundary(cache: PagedKVCache, layer: int) -> tuple[int | None, int | None]:
    """The addresses of `layer`'s boundary states and their valid flags (None, None: not kept)."""
    states = cache.boundary_states.get(layer)
    if states is None:
        return None, None
    return states.data_ptr(), cache.boundary_valid[layer].data_ptr()
