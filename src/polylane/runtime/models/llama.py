"""Llama (SmolLM2 and kin): pre-norm blocks, GQA attention, SiLU-gated MLP, RoPE."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from polylane.runtime.model.layers import ForwardContext, GatedMLP, PagedAttention, RMSNorm
from polylane.runtime.model.model_config import GLOBAL, ModelConfig
from polylane.runtime.models.base import DecoderModel


class LlamaLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = PagedAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.activation)

    def forward(self, hidden: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(DecoderModel):
    layer_class = LlamaLayer


# GGUF block tensor → Hugging Face name (after "model.layers.{i}.").
# The native layer stack (runtime/model/native/decoder.c) computes this architecture; False: torch only.
NATIVE_STACK = True
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def config_from_gguf(meta: dict[str, Any], arch: str = "llama", **overrides: Any) -> ModelConfig:
    heads = int(meta[f"{arch}.attention.head_count"])
    hidden = int(meta[f"{arch}.embedding_length"])
    num_layers = int(meta[f"{arch}.block_count"])
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size") or meta["__vocab_size"]),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        intermediate_size=int(meta[f"{arch}.feed_forward_length"]),
        rms_norm_eps=float(meta[f"{arch}.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_context=int(meta[f"{arch}.context_length"]),
        layer_types=(GLOBAL,) * num_layers,
        tie_embeddings=not meta["__has_output"],
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def hf_config(config: ModelConfig, fields: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face config.json of this architecture: `fields` (the sizes every one has) and its
    own keys (`runtime/residency/siblings.py` writes it)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", **fields}


def config_from_hf(cfg: dict[str, Any], **overrides: Any) -> ModelConfig:
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    num_layers = int(cfg["num_hidden_layers"])
    fields: dict[str, Any] = dict(
        architecture=cfg["model_type"],
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_parameters(cfg).get("rope_theta", 10000.0)),
        max_context=int(cfg.get("max_position_embeddings", 4096)),
        layer_types=(GLOBAL,) * num_layers,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def rope_parameters(cfg: dict[str, Any], layer_kind: str | None = None) -> dict[str, Any]:
    """RoPE settings from the transformers 5 (`rope_parameters`) or 4 (`rope_theta`) layout.

    Models with per-layer-type RoPE (Gemma 3) nest them: {"full_attention": {...},
    "sliding_attention": {...}}; `layer_kind` picks one.
    """
    params = dict(cfg.get("rope_parameters") or {})
    if layer_kind is not None and isinstance(params.get(layer_kind), dict):
        params = dict(params[layer_kind])
    scaling = cfg.get("rope_scaling") or {}
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
        raise ValueError(f"RoPE scaling type {rope_type!r} is not supported yet")
    return params


def unpermute_gguf_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row order of Q/K so rotate-half RoPE applies."""
    head_dim_half = weights.shape[0] // num_heads // 2
    grouped = weights.reshape(num_heads, head_dim_half, 2, *weights.shape[1:])
    return grouped.swapaxes(2, 1).reshape(weights.shape)


def transform_gguf_tensor(name: str, weights: np.ndarray, config: ModelConfig) -> np.ndarray:
    if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
        return unpermute_gguf_qk(weights, config.num_heads)
    if name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
        return unpermute_gguf_qk(weights, config.num_kv_heads)
    return weights
