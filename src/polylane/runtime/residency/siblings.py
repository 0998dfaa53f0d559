"""Sibling models: a copy of a model with its top layers changed and its lower layers byte-identical.

What this module owns: writing a new Hugging Face folder (config.json, model.safetensors, tokenizer
files, and `sibling.json` saying how it was made) from an existing model (a catalogue name, a GGUF
file or a Hugging Face folder), with the tensors of its top N layers changed by either

- a seeded perturbation (`seed`): Gaussian noise of `scale` times each tensor's standard
  deviation, for tests and benchmarks; or
- a short fine-tune (`finetune_text`): a few AdamW steps of next-token loss on a text file, only the
  top N layers trainable (through `transformers`, which trains; our decoder only runs inference).

Every other tensor is written exactly as our loader receives it from the source (Hugging Face
names and row order, float32 for a GGUF source, the file's own dtype for a folder), so the
sibling's lower layers load into bit-identical run-time tensors and the two models share the
layer band `[0, num_layers - N)` (`policy.sharing.layer_share`). `write_sibling` checks that by loading
both and comparing their digests, which also caches those digests for the engine.

The serve config declares siblings (`server.config`); `polylane models sibling` writes one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from polylane import catalog
from polylane.policy.sharing.layer_share import SharedBand, shared_band
from polylane.runtime.model.model_config import ModelConfig
from polylane.runtime.models import ARCHITECTURES

log = logging.getLogger(__name__)

SIBLING_RECORD = "sibling.json"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class SiblingError(ValueError):
    """A sibling cannot be made as asked; the message says why."""


@dataclass(frozen=True)
class SiblingSpec:
    """How to derive a sibling: which layers change, and how.

    top_layers: the N top layers that change (1 .. num_layers). seed: seeded perturbation, noise
    of `scale` × each tensor's std. finetune_text: a UTF-8 text file to fine-tune the top layers on
    for `steps` AdamW steps (learning rate `learning_rate`, windows of `sequence_length` tokens).
    Exactly one of `seed` and `finetune_text`.
    """

    top_layers: int
    seed: int | None = None
    scale: float = 0.05
    finetune_text: str | None = None
    steps: int = 20
    learning_rate: float = 1e-4
    sequence_length: int = 128

    def __post_init__(self) -> None:
        if self.top_layers < 1:
            raise SiblingError(f"top_layers must be >= 1, got {self.top_layers}")
        if (self.seed is None) == (self.finetune_text is None):
            raise SiblingError("give exactly one of seed (perturbation) and finetune_text (fine-tune)")
        if self.scale <= 0 or self.steps < 1 or self.learning_rate <= 0 or self.sequence_length < 2:
            raise SiblingError("scale and learning_rate must be > 0, steps >= 1, sequence_length >= 2")

    def key(self) -> str:
        """A short stable name for this spec (for cache folders of declared siblings)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class SiblingReport:
    """What `write_sibling` wrote: the folder, which layers changed, and the band it shares with
    its source (checked at fp32) — plus the fine-tune's losses, first to last step."""

    path: Path
    source: str
    num_layers: int
    changed_layers: tuple[int, ...]
    band: SharedBand | None
    losses: tuple[float, ...] = ()


def write_sibling(
    source: str, out: str | Path, spec: SiblingSpec, *, verify: bool = True, quiet: bool = True
) -> SiblingReport:
    """Write a sibling of `source` into the new folder `out` (which must not exist).

    With `verify`, load both through our loader and check that they share exactly the layers
    below the changed ones (SiblingError otherwise; the folder is kept for inspection).
    """
    out = Path(out)
    if out.exists():
        raise SiblingError(f"{out}: already exists (remove it, or choose another folder)")
    resolved = catalog.resolve(source, quiet=quiet)
    config, tensors, hf_config, write_tokenizer = _read_source(resolved)
    if spec.top_layers > config.num_layers:
        raise SiblingError(
            f"{source} has {config.num_layers} layers; cannot change the top {spec.top_layers}"
        )
    first_changed = config.num_layers - spec.top_layers
    changed = [name for name in tensors if _layer_of(name) is not None and _layer_of(name) >= first_changed]
    out.parent.mkdir(parents=True, exist_ok=True)
    losses: tuple[float, ...] = ()
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-", dir=out.parent) as tmp:
        folder = Path(tmp) / out.name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(hf_config, indent=1))
        write_tokenizer(folder)
        _check_config(folder, config)
        if spec.seed is not None:
            _perturb(tensors, changed, spec.seed, spec.scale)
        else:
            _save_tensors(folder, tensors)  # transformers trains from the unchanged copy
            losses = _finetune(folder, tensors, changed, first_changed, spec, quiet)
        _save_tensors(folder, tensors)
        record = {"source": source, "source_path": str(resolved.path), "changed_layers": spec.top_layers}
        (folder / SIBLING_RECORD).write_text(json.dumps({**record, "spec": asdict(spec)}, indent=1))
        folder.rename(out)
    band = _verify(source, out, first_changed, quiet) if verify else None
    return SiblingReport(
        out, source, config.num_layers, tuple(range(first_changed, config.num_layers)), band, losses
    )


def siblings_dir() -> Path:
    return catalog.cache_dir() / "siblings"


def sibling_path(source: str, spec: SiblingSpec) -> Path:
    """Where a declared sibling of `source` lives in the cache: named by the source and the spec
    (and the fine-tuning text's bytes, so editing the text makes a new sibling)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(source).name or source)
    key = {"source": source, "spec": spec.key()}
    if spec.finetune_text is not None:
        key["text"] = hashlib.sha256(Path(spec.finetune_text).read_bytes()).hexdigest()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return siblings_dir() / f"{stem}-top{spec.top_layers}-{digest}"


def ensure_sibling(
    source: str, spec: SiblingSpec, out: str | Path | None = None, *, quiet: bool = True
) -> Path:
    """The sibling's folder (`out`, or its place in the cache), written first if it is not there."""
    path = Path(out) if out is not None else sibling_path(source, spec)
    if (path / SIBLING_RECORD).is_file():
        return path
    try:
        write_sibling(source, path, spec, quiet=quiet)
    except OSError:  # another process wrote it meanwhile
        if not (path / SIBLING_RECORD).is_file():
            raise
    return path


# ---------------------------------------------------------------- reading the source


def _read_source(
    source: catalog.ModelSource,
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any], Callable[[Path], None]]:
    """(config, tensors by Hugging Face name as our loader receives them, config.json, and a
    function writing the tokenizer files into a folder)."""
    from polylane.runtime.loading.loader import gguf_config, gguf_tensors, open_gguf, read_config

    if source.format == "gguf":
        from polylane.runtime.sampling.tokenizer import load_tokenizer

        file = open_gguf(source.path)
        _, module, config = gguf_config(file)
        tensors = dict(gguf_tensors(file, module, config, progress=False))
        tokenizer = load_tokenizer(source)

        def write_tokenizer(folder: Path) -> None:
            tokenizer.backend.save_pretrained(folder)

        return config, tensors, hf_config_dict(config, tokenizer.backend), write_tokenizer

    from safetensors.torch import load_file

    config = read_config(source.path, "hf")
    tensors = {}
    for file in sorted(source.path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    hf_config = json.loads((source.path / "config.json").read_text())

    def copy_tokenizer(folder: Path) -> None:
        for path in source.path.iterdir():
            if path.is_file() and (path.name in _TOKENIZER_FILES or path.name.startswith("tokenizer")):
                shutil.copy2(path, folder / path.name)

    return config, tensors, hf_config, copy_tokenizer


def hf_config_dict(config: ModelConfig, tokenizer: Any = None) -> dict[str, Any]:
    """A Hugging Face config.json for `config` (llama, qwen2, gemma3), read back by our loader as
    the same `ModelConfig` (checked by `write_sibling`)."""
    fields: dict[str, Any] = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_context,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": "float32",
    }
    if tokenizer is not None:
        fields.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    architecture = ARCHITECTURES.get(config.architecture)
    if architecture is None:
        raise SiblingError(f"cannot write a config.json for architecture {config.architecture!r}")
    return architecture[1].hf_config(config, fields)


def _check_config(folder: Path, config: ModelConfig) -> None:
    from polylane.runtime.loading.loader import read_config

    written = read_config(folder, "hf")
    if written != config:
        differ = [k for k, v in asdict(config).items() if asdict(written)[k] != v]
        raise SiblingError(f"the written config.json reads back differently ({', '.join(differ)})")


def _layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match[1]) if match else None


# ---------------------------------------------------------------- changing the top layers


def _perturb(tensors: dict[str, torch.Tensor], names: list[str], seed: int, scale: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    for name in sorted(names):
        tensor = tensors[name]
        original = tensor.float()
        spread = original.std().item() if original.numel() > 1 else abs(original.item())
        noise = torch.randn(original.shape, generator=generator) * (scale * (spread or 1.0))
        tensors[name] = (original + noise).to(tensor.dtype).contiguous()


def _finetune(
    folder: Path,
    tensors: dict[str, torch.Tensor],
    names: list[str],
    first_changed: int,
    spec: SiblingSpec,
    quiet: bool,
) -> tuple[float, ...]:
    """Train layers >= first_changed of the model in `folder` on the text; write the trained
    tensors of `names` into `tensors`; return the loss of each step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert spec.finetune_text is not None
    text = Path(spec.finetune_text).read_text(encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(folder).encode(text)
    if len(ids) < 2:
        raise SiblingError(f"{spec.finetune_text}: too little text to fine-tune on")
    length = min(spec.sequence_length, len(ids))
    windows = [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)] or [ids]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    trainable = []
    for name, parameter in model.named_parameters():
        layer = _layer_of(name)
        parameter.requires_grad_(layer is not None and layer >= first_changed)
        if parameter.requires_grad:
            trainable.append(parameter)
    optimizer = torch.optim.AdamW(trainable, lr=spec.learning_rate, weight_decay=0.0)
    losses = []
    for step in range(spec.steps):
        batch = torch.tensor([windows[step % len(windows)]])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if not quiet:
            print(f"fine-tune step {step + 1}/{spec.steps}: loss {losses[-1]:.4f}", flush=True)
    state = model.state_dict()
    for name in names:
        trained = state.get(name)
        if trained is None:
            raise SiblingError(f"transformers' model has no tensor {name!r} to take the trained weights from")
        tensors[name] = trained.detach().to(tensors[name].dtype).contiguous().clone()
    return tuple(losses)


def _save_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), {"format": "pt"}
    )


# ---------------------------------------------------------------- checking


def _verify(source: str, out: Path, first_changed: int, quiet: bool) -> SharedBand:
    from polylane.runtime.loading.loaded_model import load_model

    base = load_model(source, "fp32", quiet=quiet, device="cpu")  # only their digests are needed
    sibling = load_model(str(out), "fp32", quiet=quiet, device="cpu")
    assert base.digest is not None and sibling.digest is not None
    band = shared_band(base.digest, sibling.digest)
    if band.layers != first_changed:
        raise SiblingError(
            f"{out}: expected to share layers [0, {first_changed}) with {source}, but shares "
            f"[0, {band.layers}) ({band.reason}); the lower layers did not load byte-identical"
        )
    return band
