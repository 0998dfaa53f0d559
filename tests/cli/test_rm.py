"""`polylane rm`: a catalogue model's fetched file and the converted weights made from it are
removed (other entries stay); `--converted-only` keeps the file; a local file keeps itself and
loses only its conversions; an unknown name is a clear error."""

from __future__ import annotations

import pytest

from polylane import catalog
from polylane.cli import main
from polylane.runtime.loading import converted
from polylane.runtime.loading.file_identity import content_digest

NAME = "smollm2-135m-instruct"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _conversion_of(path) -> object:
    entry = converted.converted_dir() / f"{path.stem}-{content_digest(path)[:32]}-fp32-v1.safetensors"
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_bytes(b"x" * 1000)
    return entry


def _fetched() -> object:
    path = catalog.cached_path(catalog.CATALOG[NAME])
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF" + bytes(4096))
    return path


def test_rm_removes_the_fetched_file_and_its_conversions_only(cache, tmp_path, capsys):
    fetched = _fetched()
    mine = _conversion_of(fetched)
    other_file = tmp_path / "other.gguf"
    other_file.write_bytes(b"GGUF" + bytes(100))
    other = _conversion_of(other_file)
    assert main(["rm", NAME]) == 0
    assert not fetched.exists() and not fetched.parent.exists()
    assert not mine.exists() and other.exists()
    assert "removed the fetched file" in capsys.readouterr().out


def test_rm_converted_only_keeps_the_file(cache):
    fetched = _fetched()
    mine = _conversion_of(fetched)
    assert main(["rm", NAME, "--converted-only"]) == 0
    assert fetched.exists() and not mine.exists()


def test_rm_of_a_local_file_removes_only_its_conversions(cache, tmp_path):
    local = tmp_path / "mine.gguf"
    local.write_bytes(b"GGUF" + bytes(200))
    mine = _conversion_of(local)
    assert main(["rm", str(local)]) == 0
    assert local.exists() and not mine.exists()


def test_rm_of_an_unknown_name_is_a_clear_error(cache, capsys):
    assert main(["rm", "no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err
