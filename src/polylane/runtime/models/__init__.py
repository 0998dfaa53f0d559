"""Decoder architectures by name: the one place to add one.

What this package owns: each architecture's module class and module (`models/<name>.py`: how to
read its GGUF and Hugging Face configs and tensors, `hf_config` for the config.json a sibling
folder gets, `NATIVE_STACK`: whether the C layer stack computes it), registered in ARCHITECTURES,
which the loader, the native stack and the sibling writer all ask.
"""

from __future__ import annotations

from types import ModuleType

import polylane.runtime.models.gemma3 as gemma3
import polylane.runtime.models.llama as llama
import polylane.runtime.models.qwen2 as qwen2
from polylane.runtime.models.base import DecoderModel

ARCHITECTURES: dict[str, tuple[type[DecoderModel], ModuleType]] = {
    "llama": (llama.LlamaModel, llama),
    "qwen2": (qwen2.Qwen2Model, qwen2),
    "gemma3": (gemma3.Gemma3Model, gemma3),
}

# Hugging Face `model_type` → our architecture name.
HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3", "gemma3": "gemma3"}
