"""A model ready to run: weights at a dtype, tokenizer, and how long loading took."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from polylane import catalog
from polylane.runtime.loader import load_weights, parse_dtype
from polylane.runtime.model_config import ModelConfig
from polylane.runtime.models.base import DecoderModel
from polylane.runtime.tokenizer import Tokenizer, load_tokenizer


@dataclass
class LoadedModel:
    name: str
    source: catalog.ModelSource
    config: ModelConfig
    module: DecoderModel
    tokenizer: Tokenizer
    dtype: torch.dtype
    weight_bytes: int
    load_seconds: float


def load_model(name_or_path: str, dtype: str | torch.dtype = "fp32", quiet: bool = False) -> LoadedModel:
    """Resolve (fetching a catalogue model on first use), read weights and tokenizer."""
    source = catalog.resolve(name_or_path, quiet=quiet)
    started = time.perf_counter()
    weights = load_weights(source.path, source.format, dtype, progress=not quiet)
    tokenizer = load_tokenizer(source)
    return LoadedModel(
        name=source.name,
        source=source,
        config=weights.config,
        module=weights.model,
        tokenizer=tokenizer,
        dtype=parse_dtype(dtype),
        weight_bytes=weights.weight_bytes,
        load_seconds=time.perf_counter() - started,
    )
