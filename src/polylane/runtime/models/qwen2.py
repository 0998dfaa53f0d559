"""Qwen2 (Qwen2.5 and Qwen2.5-Coder): the Llama block with biases on Q, K and V."""

from __future__ import annotations

from typing import Any

import numpy as np

import polylane.runtime.models.llama as llama
from polylane.runtime.model.model_config import ModelConfig
from polylane.runtime.models.base import DecoderModel


class Qwen2Model(DecoderModel):
    layer_class = llama.LlamaLayer


# The native layer stack (runtime/model/native/decoder.c) computes this architecture; False: torch only.
NATIVE_STACK = True
GGUF_LAYER_NAMES = llama.GGUF_LAYER_NAMES


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    return llama.config_from_gguf(meta, arch="qwen2", qkv_bias=True)


def hf_config(config: ModelConfig, fields: dict[str, Any]) -> dict[str, Any]:
    """llama.hf_config for Qwen2."""
    model = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu"}
    return {**model, "use_sliding_window": False, **fields}


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("use_sliding_window"):
        raise ValueError("Qwen2 sliding-window attention is not supported yet")
    return llama.config_from_hf(cfg, qkv_bias=True)


def transform_gguf_tensor(name: str, weights: np.ndarray, config: ModelConfig) -> np.ndarray:
    return weights  # llama.cpp keeps Qwen2's rotate-half row order
