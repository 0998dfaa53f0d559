"""GGUF models converted once into safetensors at their run-time dtype and layout.

What this module owns: the converted-weights cache. Dequantising a GGUF file costs seconds per
load; after the first load the built model's parameters (already fused, permuted, transposed and
cast: exactly what the decoder runs) are written next to the fetched models, under
`<cache dir>/converted/`, and every later load of the same file at the same dtype reads them back
without dequantising anything.

An entry is keyed by the source file's name, size and modification time, the dtype and
`LAYOUT_VERSION`; bump `LAYOUT_VERSION` whenever the run-time parameter layout changes (fusion,
row order, transposition), so no stale entry is ever used. Entries are written atomically (temp
file, then rename); a corrupt entry is deleted and the model is reloaded from its GGUF file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch

from polylane import catalog
from polylane.runtime.loader import ARCHITECTURES, LoadedWeights, _parameter_bytes
from polylane.runtime.model_config import ModelConfig

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def converted_dir() -> Path:
    return catalog.cache_dir() / "converted"


def converted_path(source: Path, dtype: torch.dtype) -> Path:
    stat = source.stat()
    key = f"{source.stem}-{stat.st_size}-{stat.st_mtime_ns}-{DTYPE_NAMES[dtype]}-v{LAYOUT_VERSION}"
    return converted_dir() / f"{key}.safetensors"


def save_converted(weights: LoadedWeights, target: Path) -> None:
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().contiguous() for name, p in weights.model.named_parameters()}
    metadata = {
        "config": json.dumps(dataclasses.asdict(weights.config)),
        "layout_version": str(LAYOUT_VERSION),
    }
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(temporary), metadata=metadata)
        os.replace(temporary, target)
    except OSError as error:  # a full disk must not fail the load that already succeeded
        log.warning("could not cache converted weights at %s: %s", target, error)
        temporary.unlink(missing_ok=True)


def load_converted(target: Path, dtype: torch.dtype) -> LoadedWeights | None:
    """The cached conversion, or None when there is none (or it is unreadable: then it is removed)."""
    if not target.is_file():
        return None
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(target), framework="pt") as handle:
            metadata = handle.metadata() or {}
        fields = json.loads(metadata["config"])
        fields["layer_types"] = tuple(fields["layer_types"])
        config = ModelConfig(**fields)
        # Copied into torch's own 64-byte-aligned storage: the file's offsets are not aligned, and
        # MKL's kernels sum in a different order on unaligned data (float32 results differ ~1e-5).
        tensors = {name: tensor.clone() for name, tensor in load_file(str(target)).items()}
        model_class, _ = ARCHITECTURES[config.architecture]
        with torch.device("meta"):
            model = model_class(config)
            model.choose_layouts(dtype)
        model.load_state_dict(tensors, strict=True, assign=True)
    except Exception as error:  # corrupt, truncated or from another layout: start over
        log.warning("discarding unreadable converted weights %s: %s", target, error)
        target.unlink(missing_ok=True)
        return None
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    model.prepare()
    return LoadedWeights(config, model.eval(), _parameter_bytes(model))
