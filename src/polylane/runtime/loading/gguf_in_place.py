"""Load a GGUF file at dtype "auto" (or "auto-fp32"): its quantised tensors used in place, nothing converted.

What this module owns: building our decoder from a GGUF file so that every projection, the token
embedding and the output matrix compute from the file's own blocks in its memory mapping
(`runtime.model.block_weights`), while the small tensors (norms, biases) are read as float32 the usual
way (`loader.build`). Q and K rows, which our decoder keeps in interleaved rotary order, are read
through row maps rather than reordered; fused QKV and gate/up projections are segment lists, one
per file tensor, each in its own format. A tensor in a format without a kernel fails the load with
its name and format, and the way out (`--dtype fp32` or `bf16` dequantises instead).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from polylane.runtime.loading.gguf_file import GGUFFile
from polylane.runtime.loading.loader import (
    LoadedWeights,
    LoadError,
    build,
    check_finite,
    gguf_config,
    gguf_tensors,
    hf_name,
    open_gguf,
    to_runtime_order,
)
from polylane.runtime.model.block_weights import BlockEmbedding, BlockProjection, BlockTensor, unsupported
from polylane.runtime.model.model_config import ModelConfig
from polylane.runtime.models.base import DecoderModel

log = logging.getLogger(__name__)

# our fused projections: module path within a layer → the Hugging Face projections it stacks
FUSED = {
    ("self_attn", "qkv_proj"): ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn", "o_proj"): ("self_attn.o_proj",),
    ("mlp", "gate_up_proj"): ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp", "down_proj"): ("mlp.down_proj",),
}


def load_gguf_in_place(path: str | Path, progress: bool = False, activation_bits: int = 8) -> LoadedWeights:
    """The decoder of a GGUF file computing from the file's blocks in place (see module doc), its
    activations rounded to 8 bits for integer dot products (`activation_bits` 8) or float32 (32)."""
    path = Path(path)
    file = open_gguf(path)
    model_class, module, config = gguf_config(file)
    by_hf_name = {hf_name(name, module): name for name in file.tensors}
    by_hf_name.pop(None, None)

    def tensor(name: str) -> BlockTensor:
        gguf_name = by_hf_name.get(name)
        if gguf_name is None:
            raise LoadError(f"{path}: missing tensor for {name}")
        info = file.tensors[gguf_name]
        if len(info.shape) != 2:
            raise LoadError(f"{path}: tensor {gguf_name!r} has shape {info.shape}, expected a matrix")
        check_finite(file, gguf_name)
        block = BlockTensor(gguf_name, info.type_id, info.shape[0], info.shape[1], file.raw(gguf_name))
        if (problem := unsupported(block)) is not None:
            raise LoadError(f"{path}: {problem}; load it with --dtype fp32 or bf16 (dequantised) instead")
        return block

    def projection(names: tuple[str, ...], bias: bool) -> BlockProjection:
        parts = [tensor(f"{name}.weight") for name in names]
        maps = [
            _row_map(module, f"{name}.weight", part.rows, config)
            for name, part in zip(names, parts, strict=True)
        ]
        try:
            return BlockProjection(parts, maps, bias=bias, activation_bits=activation_bits)
        except ValueError as error:
            raise LoadError(f"{path}: {error}") from None

    def swap_in(model: DecoderModel) -> None:
        for index, layer in enumerate(model.layers):
            for (parent, child), names in FUSED.items():
                full = tuple(f"model.layers.{index}.{name}" for name in names)
                bias = child == "qkv_proj" and config.qkv_bias
                setattr(getattr(layer, parent), child, projection(full, bias))
        embedding = tensor("model.embed_tokens.weight")
        model.embed_tokens = BlockEmbedding(embedding)  # type: ignore[assignment]
        model.vocab_columns = None
        if config.tie_embeddings:
            model.lm_head = BlockProjection([embedding], [None], activation_bits=activation_bits)  # type: ignore[assignment]
        else:
            model.lm_head = projection(("lm_head",), False)  # type: ignore[assignment]

    skip = frozenset(_block_tensor_names(file, module, config))
    model = build(
        model_class, config, torch.float32, gguf_tensors(file, module, config, progress, skip), path, swap_in
    )
    for block in model.modules():
        if isinstance(block, BlockProjection):
            block.bind()  # `build` gave it a new bias parameter
    return LoadedWeights(config, model, distinct_bytes(model))


def distinct_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers, memory shared between them counted once (a tied
    embedding is the lookup table and the output matrix)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.nbytes)
    return sum(seen.values())


def _block_tensor_names(file: GGUFFile, module: Any, config: ModelConfig) -> list[str]:
    """The GGUF names of the tensors used in place: every projection's weight, the embedding and
    the output matrix."""
    projections = {name for names in FUSED.values() for name in names}
    names = []
    for gguf_name in file.tensors:
        name = hf_name(gguf_name, module)
        if name is None or not name.endswith(".weight"):
            continue
        stem = name.removesuffix(".weight")
        if stem in ("model.embed_tokens", "lm_head") or stem.split(".", 3)[-1] in projections:
            names.append(gguf_name)
    return names


def _row_map(module: Any, name: str, rows: int, config: ModelConfig) -> np.ndarray | None:
    """For each of our output rows, the file row it is (the loader's reordering of Q/K rows, found
    by applying it to the row indices); None where the order is the file's."""
    index = np.arange(rows, dtype=np.float64)[:, None]
    order = np.ascontiguousarray(module.transform_gguf_tensor(name, index, config))
    order = to_runtime_order(name, torch.from_numpy(order), config)[:, 0].numpy().astype(np.int64)
    return None if np.array_equal(order, np.arange(rows)) else order


__all__ = ["distinct_bytes", "load_gguf_in_place"]
