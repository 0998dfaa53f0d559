"""The digest cache: keyed by file identity and dtype, invalidated by any change to the files,
pruned to the most recently used entries (no model is loaded here)."""

from __future__ import annotations

import os

from polylane import catalog
from polylane.policy.sharing.layer_share import ModelDigest
from polylane.runtime.loading import digests
from polylane.runtime.loading.file_identity import keep_most_recent

DIGEST = ModelDigest(
    embedding="e", layers=("a", "b"), head="h", tokenizer="t", rope="r", kv_layout="k", compute="c"
)


def _folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    return catalog.ModelSource("model", folder, "hf")


def test_saved_digest_is_found_until_a_file_changes(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "cache"))
    source = _folder(tmp_path)
    assert digests.cached_digest(source, "fp32") is None
    digests.save_digest(source, "fp32", DIGEST)
    assert digests.cached_digest(source, "fp32") == DIGEST
    assert digests.cached_digest(source, "float32") == DIGEST, "dtype names are canonical"
    assert digests.cached_digest(source, "bf16") is None, "another dtype, other bytes"
    (source.path / "tokenizer.json").write_text("{}")  # any file of the folder counts
    assert digests.cached_digest(source, "fp32") is None


def test_unreadable_entry_is_ignored(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "cache"))
    source = _folder(tmp_path)
    digests.save_digest(source, "fp32", DIGEST)
    digests.digest_path(source, "fp32").write_text("{not json")
    assert digests.cached_digest(source, "fp32") is None


def test_prune_keeps_the_most_recently_used(tmp_path) -> None:
    for index in range(5):
        entry = tmp_path / f"{index}.json"
        entry.write_text("{}")
        os.utime(entry, ns=(index * 10**9, index * 10**9))
    os.utime(tmp_path / "0.json")  # read just now
    keep_most_recent(tmp_path, "*.json", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.json", "4.json"]
