"""Compile and load polylane's C kernels, once per machine, on first use.

What this module owns: turning a C file shipped in this package into a shared library with the
machine's C compiler (`cc -O3 -march=native -fopenmp`), cached next to the models under a name
that changes with the source, the compiler, the flags and the CPU, and loading it with ctypes; and
compiling the bench harnesses that #include the kernels (`build_program`) with the same flags. A
missing compiler or a failed build is not an error: `load_library` returns None (and logs why
once) and callers keep their torch path. `POLYLANE_NATIVE=0` turns the kernels off;
`POLYLANE_NATIVE_MARCH=haswell` (any `-march` value) builds for an older instruction set than the
CPU's, so that one machine can run what another family gets (e.g. an AVX2-only CPU's paths);
`POLYLANE_NATIVE_PORTABLE=1` builds the portable C paths, with no intrinsics (what ARM gets).

The library links the OpenMP runtime by its soname, libgomp.so.1, which torch has already loaded:
the kernels and torch share one OpenMP thread team (two teams on two cores made every parallel op
pay a wake-up, docs/profile.md).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loads torch's libgomp before any kernel library does)

from polylane import catalog

log = logging.getLogger(__name__)

NATIVE_ENV = "POLYLANE_NATIVE"
MARCH_ENV = "POLYLANE_NATIVE_MARCH"
PORTABLE_ENV = "POLYLANE_NATIVE_PORTABLE"
SOURCE_DIR = Path(__file__).parent


def portable() -> bool:
    """Whether the kernels are built without x86 intrinsics (POLYLANE_NATIVE_PORTABLE=1): the C
    an ARM or any other CPU compiles, forced here to test it."""
    return os.environ.get(PORTABLE_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def compile_flags() -> tuple[str, ...]:
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    flags = ("-O3", f"-march={march}", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")
    return (*flags, "-DPOLYLANE_PORTABLE") if portable() else flags


def enabled() -> bool:
    return os.environ.get(NATIVE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _cpu_signature() -> str:
    """The CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library_path(source: Path, compiler: str) -> Path:
    """Where the library built from `source` by `compiler` on this CPU is cached."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256()
    sources = b"".join(path.read_bytes() for path in sorted(source.parent.glob("*.c")))  # (#included too)
    for part in (sources, version, " ".join(compile_flags()), _cpu_signature()):
        digest.update(part if isinstance(part, bytes) else part.encode())
    return catalog.cache_dir().parent / "kernels" / f"{source.stem}-{digest.hexdigest()[:16]}.so"


def build_library(source: Path, target: Path, compiler: str, extra_flags: tuple[str, ...] = ()) -> None:
    """Compile `source` into the shared library `target` with this machine's flags (then
    `extra_flags`); RuntimeError with the compiler's message where it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # built under a temporary name and renamed: concurrent processes never load a partial file
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        result = subprocess.run(
            [compiler, *compile_flags(), *extra_flags, "-o", partial, str(source), "-lm"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source.name}:\n{result.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def build_program(source: Path, target: Path) -> None:
    """Compile `source`, a stand-alone C program that #includes this package's kernels (the
    harnesses under bench/), into the executable `target` with the kernels' flags; RuntimeError
    where there is no compiler or it fails."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    flags = [flag for flag in compile_flags() if flag not in ("-shared", "-fPIC")]
    command = [compiler, *flags, "-D_DEFAULT_SOURCE", f"-I{SOURCE_DIR}", "-o", str(target), str(source)]
    command.append("-lm")
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as error:
        raise RuntimeError(f"cannot run the C compiler {compiler}: {error}") from error
    if result.returncode != 0:
        raise RuntimeError(f"{compiler} failed on {source.name}:\n{result.stderr.strip()[-2000:]}")


@functools.cache
def load_library(name: str) -> ctypes.CDLL | None:
    """The compiled library of `name`.c in this package, building it on first use; None (and one
    log line saying why) when native kernels are off or cannot be built here."""
    if not enabled():
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: polylane runs its torch kernels only")
        return None
    source = SOURCE_DIR / f"{name}.c"
    try:
        target = library_path(source, compiler)
        if not target.exists():
            log.info("building polylane's %s kernels with %s (once per machine)", name, compiler)
            build_library(source, target, compiler)
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as error:
        log.warning("polylane's %s kernels are unavailable, using torch's: %s", name, error)
        return None
