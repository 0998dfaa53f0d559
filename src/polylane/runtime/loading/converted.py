"""GGUF models converted once into safetensors at their run-time dtype and layout.

What this module owns: the converted-weights cache. Dequantising a GGUF file costs seconds per
load; after the first load the built model's parameters (already fused, permuted, transposed and
cast: exactly what the decoder runs) are written next to the fetched models, under
`<cache dir>/converted/`, and every later load of the same file at the same dtype reads them back
without dequantising anything.

An entry is keyed by the source file's content (`runtime.loading.file_identity`: a sha256 of its bytes,
not its name, size and modification time, which two different files can share), the dtype and
`LAYOUT_VERSION`; bump `LAYOUT_VERSION` whenever the run-time parameter layout changes (fusion,
row order, transposition), so no stale entry is ever used. Entries are written atomically (temp
file, then rename); a corrupt entry is deleted and the model is reloaded from its GGUF file. The
entries together stay under `max_cache_bytes()` (`POLYLANE_CONVERTED_CAP`, default 8 GiB): after
each write the least recently used ones go.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch

from polylane import catalog
from polylane.runtime.loading.file_identity import content_digest
from polylane.runtime.loading.loader import ARCHITECTURES, LoadedWeights, _parameter_bytes
from polylane.runtime.model.model_config import ModelConfig

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def converted_dir() -> Path:
    return catalog.cache_dir() / "converted"


CAP_ENV = "POLYLANE_CONVERTED_CAP"
DEFAULT_CAP_BYTES = 8 << 30


def max_cache_bytes() -> int:
    """The most bytes the converted entries may take together ($POLYLANE_CONVERTED_CAP, bytes)."""
    value = os.environ.get(CAP_ENV, "").strip()
    return int(value) if value.isdigit() else DEFAULT_CAP_BYTES


def converted_path(source: Path, dtype: torch.dtype) -> Path:
    content = content_digest(source)[:32]
    return converted_dir() / f"{source.stem}-{content}-{DTYPE_NAMES[dtype]}-v{LAYOUT_VERSION}.safetensors"


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
        return
    prune(max_cache_bytes(), keep=target)


def prune(cap_bytes: int, keep: Path | None = None) -> list[Path]:
    """Remove the least recently used entries until the rest take at most `cap_bytes` (`keep`, the
    entry just written, stays); the removed paths."""
    try:
        entries = sorted(converted_dir().glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
        total = sum(p.stat().st_size for p in entries)
    except OSError:  # another process pruned meanwhile
        return []
    removed = []
    for entry in entries:
        if total <= cap_bytes:
            break
        if entry == keep:
            continue
        try:
            size = entry.stat().st_size
            entry.unlink()
        except OSError:
            continue
        total -= size
        removed.append(entry)
    if removed:
        log.info("removed %d converted-weights entries (least recently used) to stay under %d bytes",
                 len(removed), cap_bytes)  # fmt: skip
    return removed


def conversions_of(content: str) -> list[Path]:
    """The converted entries made from a file whose sha256 (hex) is `content` (any dtype, any
    layout version)."""
    return sorted(converted_dir().glob(f"*-{content[:32]}-*.safetensors"))


def remove_conversions(source: Path) -> list[tuple[Path, int]]:
    """Delete every converted entry made from the file `source` (any dtype, any layout version);
    the removed paths and their sizes."""
    removed = []
    for entry in conversions_of(content_digest(source)):
        try:
            size = entry.stat().st_size
            entry.unlink()
        except OSError:  # another process removed it meanwhile
            continue
        removed.append((entry, size))
    return removed


def load_converted(target: Path, dtype: torch.dtype) -> LoadedWeights | None:
    """The cached conversion, or None when there is none (or it is unreadable: then it is removed)."""
    if not target.is_file():
        return None
    os.utime(target)  # recently used: the last to be pruned
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
