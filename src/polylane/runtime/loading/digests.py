"""Per-layer digests of a loaded model, computed once per file and cached by file identity.

What this module owns: turning a loaded model (the run-time tensors the decoder actually uses,
after dequantising, fusing, transposing and casting) into a `policy.sharing.layer_share.ModelDigest`, and
the on-disk cache of those digests. Which layers two models share is decided from the digests by
`policy.sharing.layer_share`; this module only hashes.

Hashing reads every weight byte once (about 0.3 s for 540 MB on one core), so the result is kept
under `<cache dir>/digests/`, keyed by the source's content (`runtime.loading.file_identity`: every file's
name and sha256 — the GGUF file, or every file of a Hugging Face folder, tokenizer included), the
dtype it was loaded at, `DIGEST_VERSION` and the converted-weights `LAYOUT_VERSION`. Editing a file
changes its content key, so its digests are computed again from the new bytes. Because the key is
known before loading, a model's cached digests are also available before it is ever loaded on this
run (`cached_digest`), which lets its peers record boundary states for it from their first prefill.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from polylane import catalog
from polylane.policy.sharing.layer_share import ModelDigest
from polylane.runtime.loading.converted import LAYOUT_VERSION
from polylane.runtime.loading.file_identity import content_digest, keep_most_recent, write_atomically
from polylane.runtime.model.model_config import ModelConfig
from polylane.runtime.sampling.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DIGEST_VERSION = 2
MAX_CACHED_DIGESTS = 512  # entries kept under digests_dir(), most recently used first
EMBEDDING_NAMES = ("embed_tokens.weight", "vocab_columns")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def dtype_name(dtype: str | torch.dtype) -> str:
    """A canonical name for the dtype a model was asked for ("fp32", "bf16", "int4" …)."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", "float32": "fp32", "bfloat16": "bf16"}
    if isinstance(dtype, torch.dtype):
        return names.get(dtype, str(dtype))
    return names.get(dtype.lower(), dtype.lower())


# ---------------------------------------------------------------- computing


def compute_digest(
    module: torch.nn.Module, config: ModelConfig, tokenizer: Tokenizer, kv_dtype: torch.dtype
) -> ModelDigest:
    """Hash the run-time tensors of `module` (its state dict: parameters and buffers) by part;
    `kv_dtype` is the dtype its KV cache and hidden states run at."""
    embedding = hashlib.sha256()
    head = hashlib.sha256()
    layers = [hashlib.sha256(config.layer_types[i].encode()) for i in range(config.num_layers)]
    for name, value in sorted(module.state_dict().items()):
        match = _LAYER.match(name)
        if match is not None:
            _hash_entry(layers[int(match[1])], match[2], value)
        elif name in EMBEDDING_NAMES:
            _hash_entry(embedding, "embedding", value)
        else:
            _hash_entry(head, name, value)
    dtype = {"weights": _weight_dtypes(module), "kv": str(kv_dtype)}
    rope = {"theta": config.rope_theta, "local_theta": config.rope_local_theta, "head_dim": config.head_dim}
    kv_layout = {"kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "dtype": str(kv_dtype)}
    compute = {
        "architecture": config.architecture,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "rms_norm_eps": config.rms_norm_eps,
        "sliding_window": config.sliding_window,
        "qkv_bias": config.qkv_bias,
        "qk_norm": config.qk_norm,
        "sandwich_norms": config.sandwich_norms,
        "embedding_scale": config.embedding_scale,
        "attention_scale": config.attention_scale,
        "activation": config.activation,
        "dtype": dtype,
    }
    return ModelDigest(
        embedding=embedding.hexdigest(),
        layers=tuple(layer.hexdigest() for layer in layers),
        head=head.hexdigest(),
        tokenizer=tokenizer_digest(tokenizer),
        rope=_json_digest({"rope": rope, "layout": LAYOUT_VERSION}),
        kv_layout=_json_digest(kv_layout),
        compute=_json_digest(compute),
    )


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """sha256 of the tokenizer's whole definition (vocabulary, merges, added and special tokens,
    normaliser, pre-tokeniser, post-processor, decoder; not truncation or padding settings), and
    of its special token ids. A fast tokenizer saved and reloaded keeps its digest."""
    backend = tokenizer.backend
    special = {name: getattr(backend, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    inner = getattr(backend, "backend_tokenizer", None)
    if inner is not None:
        state = json.loads(inner.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
    else:  # a slow tokenizer: its vocabulary is what we can see
        state = {"vocab": sorted(backend.get_vocab().items(), key=lambda item: item[1])}
    return _json_digest({"tokenizer": state, "special": special})


def _hash_entry(hasher: Any, name: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        hasher.update(f"{name}|{value!r}".encode())
        return
    hasher.update(f"{name}|{value.dtype}|{tuple(value.shape)}|".encode())
    hasher.update(_tensor_bytes(value))


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.is_quantized:
        flat = flat.int_repr()
    return memoryview(flat.view(torch.uint8).numpy())


def _weight_dtypes(module: torch.nn.Module) -> list[str]:
    return sorted({str(t.dtype) for t in module.state_dict().values() if isinstance(t, torch.Tensor)})


def _json_digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


# ---------------------------------------------------------------- the cache


def digests_dir() -> Path:
    return catalog.cache_dir() / "digests"


def file_identity(source: catalog.ModelSource) -> list[tuple[str, str]]:
    """(name, content sha256) of the model's file, or of every file of its folder."""
    path = source.path.resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return [(p.name, content_digest(p)) for p in files]


def digest_path(source: catalog.ModelSource, dtype: str | torch.dtype) -> Path:
    key = {
        "identity": file_identity(source),
        "dtype": dtype_name(dtype),
        "digest_version": DIGEST_VERSION,
        "layout_version": LAYOUT_VERSION,
    }
    return digests_dir() / f"{source.name}-{_json_digest(key)[:32]}.json"


def cached_digest(source: catalog.ModelSource, dtype: str | torch.dtype) -> ModelDigest | None:
    """The digests saved for this exact file at this dtype, or None (never computed, unreadable,
    or the file changed since)."""
    try:
        path = digest_path(source, dtype)
        digest = ModelDigest.from_json(json.loads(path.read_text())["digest"])
        os.utime(path)  # recently used: the last to be pruned
        return digest
    except FileNotFoundError:
        return None
    except (OSError, KeyError, TypeError, ValueError) as error:
        log.warning("ignoring unreadable model digests for %s: %s", source.path, error)
        return None


def model_digest(
    source: catalog.ModelSource,
    dtype: str | torch.dtype,
    module: torch.nn.Module,
    config: ModelConfig,
    tokenizer: Tokenizer,
    kv_dtype: torch.dtype,
) -> ModelDigest:
    """The cached digests of `source` at `dtype`, else computed from `module` and saved."""
    digest = cached_digest(source, dtype)
    if digest is not None:
        return digest
    digest = compute_digest(module, config, tokenizer, kv_dtype)
    save_digest(source, dtype, digest)
    return digest


def save_digest(source: catalog.ModelSource, dtype: str | torch.dtype, digest: ModelDigest) -> None:
    """Write atomically; a failure (read-only or full disk) only costs recomputing next time."""
    target = digest_path(source, dtype)
    record = {"source": str(source.path), "dtype": dtype_name(dtype), "digest": digest.to_json()}
    if write_atomically(target, json.dumps(record, indent=1), "model digests"):
        # (temporary model folders, e.g. of tests, leave entries that are never read again)
        keep_most_recent(target.parent, "*.json", MAX_CACHED_DIGESTS)
