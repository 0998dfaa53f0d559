"""Decoder architectures by name: the module class and how to read each file format's config."""

from __future__ import annotations

from types import ModuleType

from polylane.runtime.models import gemma3, llama, qwen2
from polylane.runtime.models.base import DecoderModel

ARCHITECTURES: dict[str, tuple[type[DecoderModel], ModuleType]] = {
    "llama": (llama.LlamaModel, llama),
    "qwen2": (qwen2.Qwen2Model, qwen2),
    "gemma3": (gemma3.Gemma3Model, gemma3),
}

# Hugging Face `model_type` → our architecture name.
HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3", "gemma3": "gemma3"}
