"""The saved tokenizers: keyed by the file's header (what a tokenizer is built from), so a file
replaced by another of the same name, size and modification time (`cp -p`, `rsync -t`, `tar x`)
gets its own vocabulary, never the saved one of the file it replaced; only the most recently used
are kept."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from polylane import catalog
from polylane.runtime.sampling import tokenizer as tokenizer_module
from polylane.runtime.sampling.tokenizer import load_tokenizer
from tests.conftest import fetch_or_skip

EOS_KEY = b"tokenizer.ggml.eos_token_id"


def _with_eos(data: bytes, eos: int) -> bytes:
    """SmolLM2's file with another end-of-sequence token id (a uint32 value: same size)."""
    at = data.index(EOS_KEY) + len(EOS_KEY)
    value_type, _ = struct.unpack_from("<II", data, at)
    assert value_type == 4, value_type  # uint32
    return data[: at + 4] + struct.pack("<I", eos) + data[at + 8 :]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tokenizer_module, "cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache" / "tokenizers"


def test_a_replaced_file_with_the_same_name_size_and_mtime_gets_its_own_tokenizer(
    tmp_path, cache, monkeypatch
) -> None:
    monkeypatch.setattr(tokenizer_module, "MAX_SAVED", 1)  # and only the most recently used is kept
    data = fetch_or_skip("smollm2-135m-instruct").path.read_bytes()
    path = tmp_path / "model.gguf"
    path.write_bytes(_with_eos(data, 5))
    stamp = (1_700_000_000_000_000_000, 1_700_000_000_000_000_000)
    os.utime(path, ns=stamp)
    first = load_tokenizer(catalog.resolve(str(path), quiet=True))
    assert 5 in first.stop_token_ids and 6 not in first.stop_token_ids, first.stop_token_ids
    first_key = tokenizer_module._cache_key(path)
    path.write_bytes(_with_eos(data, 6))  # another file: same name, size and mtime
    os.utime(path, ns=stamp)
    second = load_tokenizer(catalog.resolve(str(path), quiet=True))
    assert 6 in second.stop_token_ids and 5 not in second.stop_token_ids, (
        f"the replaced file's saved tokenizer was used: {second.stop_token_ids}"
    )
    second_key = tokenizer_module._cache_key(path)
    assert second_key != first_key
    assert [p.name for p in cache.iterdir()] == [second_key], "the least recently used one stays"
