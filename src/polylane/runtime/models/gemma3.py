"""Gemma 3 (text): sandwich norms, QK-norm, scaled embeddings, 5 sliding layers per global one.

Sliding layers attend to the last `sliding_window` positions and use their own RoPE base (10,000);
global layers see everything with the main base. Norm weights follow Gemma's `1 + w` convention,
folded into a plain multiplicative weight at load.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from polylane.runtime.model.layers import ForwardContext, GatedMLP, PagedAttention, RMSNorm
from polylane.runtime.model.model_config import GLOBAL, SLIDING, ModelConfig
from polylane.runtime.models.base import DecoderModel
from polylane.runtime.models.llama import rope_parameters

SLIDING_WINDOW_PATTERN = 6  # every 6th layer is global (llama.cpp and transformers' default)
LOCAL_ROPE_THETA = 10_000.0


class Gemma3Layer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, cast_before_weight=False)
        self.self_attn = PagedAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(size, eps, cast_before_weight=False)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, cast_before_weight=False)
        self.mlp = GatedMLP(size, config.intermediate_size, config.activation)
        self.post_feedforward_layernorm = RMSNorm(size, eps, cast_before_weight=False)

    def forward(self, hidden: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), context)
        hidden = hidden + self.post_attention_layernorm(attended)
        mixed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mixed)


class Gemma3Model(DecoderModel):
    layer_class = Gemma3Layer
    gemma_norms = True


# The native layer stack (runtime/model/native/decoder.c) computes this architecture; False: torch only.
NATIVE_STACK = True
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _layer_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    return tuple(GLOBAL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    heads = int(meta["gemma3.attention.head_count"])
    hidden = int(meta["gemma3.embedding_length"])
    head_dim = int(meta.get("gemma3.attention.key_length", 256))
    num_layers = int(meta["gemma3.block_count"])
    return ModelConfig(
        architecture="gemma3",
        vocab_size=int(meta.get("gemma3.vocab_size") or meta["__vocab_size"]),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(meta.get("gemma3.attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(meta["gemma3.feed_forward_length"]),
        rms_norm_eps=float(meta["gemma3.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get("gemma3.rope.freq_base", 1_000_000.0)),
        rope_local_theta=LOCAL_ROPE_THETA,
        max_context=int(meta["gemma3.context_length"]),
        layer_types=_layer_types(num_layers, SLIDING_WINDOW_PATTERN),
        sliding_window=int(meta.get("gemma3.attention.sliding_window", 512)),
        qk_norm=True,
        sandwich_norms=True,
        embedding_scale=hidden**0.5,
        attention_scale=head_dim**-0.5,  # query_pre_attn_scalar = head_dim for these files
        activation="gelu_tanh",
        tie_embeddings=not meta["__has_output"],
    )


def _local_rope_theta(cfg: dict[str, Any]) -> float:
    """Sliding layers' RoPE base: nested in transformers 5 configs, a flat key in version 4."""
    if "sliding_attention" in (cfg.get("rope_parameters") or {}):
        return float(rope_parameters(cfg, "sliding_attention")["rope_theta"])
    return float(cfg.get("rope_local_base_freq", LOCAL_ROPE_THETA))


def hf_config(config: ModelConfig, fields: dict[str, Any]) -> dict[str, Any]:
    """llama.hf_config for Gemma 3 (its sliding layers, local RoPE base, attention scalar, soft cap)."""
    scalar = (config.attention_scale or config.head_dim**-0.5) ** -2
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": [
            "sliding_attention" if kind == SLIDING else "full_attention" for kind in config.layer_types
        ],
        "sliding_window": config.sliding_window,
        "rope_local_base_freq": config.rope_local_theta,
        "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-9 else scalar,
        "final_logit_softcapping": config.final_logit_softcap,
        **fields,
    }


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if layer_types:
        types = tuple(SLIDING if t == "sliding_attention" else GLOBAL for t in layer_types)
    else:
        types = _layer_types(num_layers, int(cfg.get("sliding_window_pattern", 6)))
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("attention logit soft-capping is not supported yet")
    return ModelConfig(
        architecture="gemma3",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim", 256)),
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_parameters(cfg, "full_attention")["rope_theta"]),
        rope_local_theta=_local_rope_theta(cfg),
        max_context=int(cfg.get("max_position_embeddings", 32768)),
        layer_types=types,
        sliding_window=int(cfg.get("sliding_window", 512)),
        qk_norm=True,
        sandwich_norms=True,
        embedding_scale=hidden**0.5,
        attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        activation="gelu_tanh",
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def transform_gguf_tensor(name: str, weights: np.ndarray, config: ModelConfig) -> np.ndarray:
    if name.endswith("norm.weight"):
        return weights - 1  # llama.cpp stores 1 + w; the Hugging Face layout stores w
    return weights
