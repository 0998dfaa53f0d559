"""The converted-weights cache: a GGUF model loaded from its safetensors conversion is bit-identical
to one dequantised from the GGUF file, a corrupt conversion is discarded, never used, entries are
keyed by the file's content (not its name, size and mtime), and the cache stays under its cap."""

from __future__ import annotations

import os

import pytest
import torch

from polylane.runtime.generate import GenerationRequest, Generator
from polylane.runtime.loading import converted, file_identity
from polylane.runtime.loading.loaded_model import load_model
from polylane.types import SamplingParams
from tests.conftest import fetch_or_skip


def _greedy(model) -> list[torch.Tensor]:
    ids = tuple(model.tokenizer.encode("Paged attention keeps the cache in blocks so that"))
    request = GenerationRequest(ids, SamplingParams(max_tokens=6), stop_at_eos=False)
    [output] = Generator(model, num_blocks=8).generate([request], record_logits=True)
    return output.logits


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_converted_load_is_bit_identical(tmp_path, monkeypatch, dtype):
    fetch_or_skip("smollm2-135m-instruct")
    monkeypatch.setattr(converted, "converted_dir", lambda: tmp_path)
    direct = load_model("smollm2-135m-instruct", dtype, quiet=True, convert_cache=False)
    first = load_model("smollm2-135m-instruct", dtype, quiet=True)  # converts and writes
    [entry] = list(tmp_path.glob("*.safetensors"))
    assert dtype in entry.name
    second = load_model("smollm2-135m-instruct", dtype, quiet=True)  # reads the conversion
    want = dict(direct.module.named_parameters())
    for name, parameter in second.module.named_parameters():
        assert torch.equal(parameter, want[name]), f"{name} differs after conversion"
    for label, model in (("first", first), ("second", second)):
        for step, (a, b) in enumerate(zip(_greedy(model), _greedy(direct), strict=True)):
            assert torch.equal(a, b), f"{label} load, step {step}: max-abs {(a - b).abs().max():.2e}"


def test_corrupt_conversion_is_discarded(tmp_path, monkeypatch):
    source = fetch_or_skip("smollm2-135m-instruct")
    monkeypatch.setattr(converted, "converted_dir", lambda: tmp_path)
    entry = converted.converted_path(source.path, torch.bfloat16)
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    model = load_model("smollm2-135m-instruct", "bf16", quiet=True)
    assert model.weight_bytes > 0
    assert entry.is_file() and entry.stat().st_size > 1_000_000, "the corrupt entry was not rewritten"


def _same_stat_pair(tmp_path, first: bytes, second: bytes):
    """Two files of one name, size and modification time in two folders."""
    paths = []
    for folder, data in (("a", first), ("b", second)):
        path = tmp_path / folder / "model-Q4_K_M.gguf"
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
        paths.append(path)
    return paths


def test_two_files_alike_but_for_their_bytes_get_two_entries(tmp_path, monkeypatch):
    """Name, size and mtime do not identify a file (fine-tunes of one base, `cp -p`): the entry is
    keyed by content, so one file is never served the other's converted weights."""
    monkeypatch.setattr(converted, "converted_dir", lambda: tmp_path / "converted")
    monkeypatch.setattr(file_identity, "hashes_dir", lambda: tmp_path / "hashes")
    one, other = _same_stat_pair(tmp_path, b"GGUF" + b"\x01" * 60, b"GGUF" + b"\x02" * 60)
    assert (one.stat().st_size, one.stat().st_mtime_ns) == (other.stat().st_size, other.stat().st_mtime_ns)
    assert converted.converted_path(one, torch.float32) != converted.converted_path(other, torch.float32)
    same, copy = _same_stat_pair(tmp_path / "c", b"GGUF" + b"\x03" * 60, b"GGUF" + b"\x03" * 60)
    assert converted.converted_path(same, torch.float32) == converted.converted_path(copy, torch.float32)


def test_a_file_rewritten_in_place_with_its_old_mtime_is_hashed_again(tmp_path, monkeypatch):
    monkeypatch.setattr(file_identity, "hashes_dir", lambda: tmp_path / "hashes")
    path = tmp_path / "model.gguf"
    path.write_bytes(b"first version...")
    stamp = path.stat().st_mtime_ns
    before = file_identity.content_digest(path)
    assert file_identity.content_digest(path) == before  # remembered
    path.write_bytes(b"other version...")  # same size
    os.utime(path, ns=(stamp, stamp))  # and the old mtime, as `cp -p` would leave it
    assert file_identity.content_digest(path) != before


def test_entries_past_the_cap_go_least_recently_used_first(tmp_path, monkeypatch):
    monkeypatch.setattr(converted, "converted_dir", lambda: tmp_path)
    entries = []
    for index in range(4):
        entry = tmp_path / f"m{index}.safetensors"
        entry.write_bytes(b"x" * 1000)
        os.utime(entry, ns=(index * 10**9, index * 10**9))
        entries.append(entry)
    removed = converted.prune(2500, keep=entries[0])
    assert removed == [entries[1], entries[2]], "the oldest but the kept one went first"
    assert [e.exists() for e in entries] == [True, False, False, True]
