"""Qwen2 (Qwen2.5 and Qwen2.5-Coder): the Llama block with biases on Q, K and V."""

from __future__ import annotations

from typing import Any

import numpy as np

from polylane.runtime.model_config import ModelConfig
from polylane.runtime.models import llama
from polylane.runtime.models.base import DecoderModel


class Qwen2Model(DecoderModel):
    layer_class = llama.LlamaLayer


GGUF_LAYER_NAMES = llama.GGUF_LAYER_NAMES


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    return llama.config_from_gguf(meta, arch="qwen2", qkv_bias=True)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("use_sliding_window"):
        raise ValueError("Qwen2 sliding-window attention is not supported yet")
    return llama.config_from_hf(cfg, qkv_bias=True)


def transform_gguf_tensor(name: str, weights: np.ndarray, config: ModelConfig) -> np.ndarray:
    return weights  # llama.cpp keeps Qwen2's rotate-half row order
