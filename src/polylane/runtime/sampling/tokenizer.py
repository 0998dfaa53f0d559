"""Tokenizer and chat template of a model, read from the model's own file.

GGUF files carry their vocabulary, merges and chat template; `transformers` turns them into a fast
(`tokenizers`) tokenizer. That conversion takes 10–40 s for large vocabularies, so the result is
saved once under the cache directory, keyed by the content it is built from (a hash of the file's
header: a name, size and modification time can be shared by two different files, and one would
then get the other's vocabulary), and later loads read the saved `tokenizer.json` in well under a
second. The MAX_SAVED most recently used are kept.

Chat templates come from model files, i.e. from strangers: `transformers` renders them in a
sandboxed Jinja2 environment.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polylane.catalog import ModelSource, cache_dir

# Tokens that end an assistant turn in the chat formats of the models we serve.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>")


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template failed to render these messages."""


class Tokenizer:
    """Text ⇄ token ids, stop tokens and chat rendering for one model."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        vocab = backend.get_vocab()
        stop = {backend.eos_token_id} if backend.eos_token_id is not None else set()
        stop |= {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
        self.stop_token_ids: frozenset[int] = frozenset(stop)
        self.vocab_size = len(vocab)
        self._digest: str | None = None

    @property
    def digest(self) -> str:
        """sha256 of what decides how text becomes ids: the token list (token, id), the merges,
        and the added/special tokens with their ids. Equal digests: interchangeable token ids
        (the condition for one model to draft for another)."""
        if self._digest is None:
            self._digest = tokenizer_digest(self.backend)
        return self._digest

    @property
    def has_chat_template(self) -> bool:
        return bool(self.backend.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of `messages` in the model's chat format, ready for the assistant's turn (with
        `tools` shown to the model as its template does)."""
        if not self.has_chat_template:
            raise ChatTemplateError(
                "this model has no chat template (it is a base model); send a plain prompt instead"
            )
        try:
            text = self.backend.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as error:
            raise ChatTemplateError(f"the model's chat template failed: {error}") from None
        # The template writes any BOS itself.
        return self.encode(text, add_special_tokens=False)


def tokenizer_digest(backend: Any) -> str:
    """See `Tokenizer.digest`."""
    hasher = hashlib.sha256()
    state = json.loads(backend.backend_tokenizer.to_str())
    model = state.get("model", {})
    vocab = model.get("vocab", {})
    items = sorted(vocab.items(), key=lambda item: item[1]) if isinstance(vocab, dict) else vocab
    hasher.update(json.dumps([model.get("type"), items], ensure_ascii=False).encode())
    hasher.update(json.dumps(model.get("merges", []), ensure_ascii=False).encode())
    added = sorted((t["id"], t["content"], bool(t.get("special"))) for t in state.get("added_tokens", []))
    hasher.update(json.dumps(added, ensure_ascii=False).encode())
    special = {name: getattr(backend, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    hasher.update(json.dumps(special, sort_keys=True).encode())
    return hasher.hexdigest()


MAX_SAVED = 64  # saved tokenizers kept, most recently used first (each a few MB to tens of MB)


def _cache_key(path: Path) -> str:
    """A sha256 of the GGUF header (metadata and tensor infos): the bytes a tokenizer is built from,
    so that files differing only in tensor data share one."""
    from polylane.runtime.loading.gguf_file import GGUFFile

    size = GGUFFile(path).header_bytes
    with path.open("rb") as handle:
        return hashlib.sha256(handle.read(size)).hexdigest()[:32]


def _prune_saved(folder: Path) -> None:
    """Delete all but the MAX_SAVED most recently used saved tokenizers."""
    try:
        entries = sorted((p for p in folder.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime_ns)
    except OSError:
        return
    for stale in entries[: max(0, len(entries) - MAX_SAVED)]:
        shutil.rmtree(stale, ignore_errors=True)


# transformers resolves its names lazily, and two threads doing that at once can see a
# half-initialised module ("cannot import name AutoTokenizer"); import it under one lock.
_TRANSFORMERS_IMPORT = threading.Lock()


def load_tokenizer(source: ModelSource) -> Tokenizer:
    with _TRANSFORMERS_IMPORT:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if source.format == "hf":
        return Tokenizer(AutoTokenizer.from_pretrained(source.path))
    saved = cache_dir() / "tokenizers" / _cache_key(source.path)
    if (saved / "tokenizer.json").is_file():
        with contextlib.suppress(OSError):
            os.utime(saved)  # recently used: the last to be pruned
        return Tokenizer(PreTrainedTokenizerFast.from_pretrained(saved))
    backend = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    saved.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=saved.parent) as tmp:
        backend.save_pretrained(tmp)
        try:
            os.replace(tmp, saved)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    _prune_saved(saved.parent)
    return Tokenizer(backend)
