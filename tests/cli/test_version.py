"""`polylane --version`: the version, the torch build and which compute path each dtype gets on
this CPU (the native stack with its matrix kernel, or torch at its CPU capability, and why)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch

from polylane.runtime.compute_paths import native_unavailable_reason
from polylane.runtime.native import stack as native
from polylane.types import WEIGHT_DTYPES


def _version(**env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "polylane.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _paths(text: str) -> dict[str, str]:
    lines = text.split("compute paths on this CPU:\n", 1)[1].splitlines()
    return {line.split()[0]: line.split(maxsplit=1)[1] for line in lines}


def test_version_names_the_build_and_each_dtypes_path() -> None:
    text = _version()
    assert text.startswith(f"polylane {importlib.metadata.version('polylane')}\n")
    assert f"torch {torch.__version__} (CPU kernels: {torch.backends.cpu.get_cpu_capability()}" in text
    assert "\nCPU: " in text
    assert "\nthreads: adaptive, " in text and "serve --threads N fixes N" in text
    paths = _paths(text)
    assert set(paths) == set(WEIGHT_DTYPES), text
    kernel = native.kernel_name()
    for dtype, path in paths.items():
        expected = f"native ({kernel})" if kernel else "torch ("
        assert path.startswith(expected), f"{dtype}: {path}"


def test_without_the_native_stack_every_dtype_says_torch_and_why() -> None:
    paths = _paths(_version(POLYLANE_NATIVE="0"))
    assert all(
        path.startswith("torch (") and "turned off (POLYLANE_NATIVE=0)" in path for path in paths.values()
    )


def test_int4_packed_for_another_capability_runs_on_torch_and_says_so() -> None:
    if native.kernel_name() is None:
        pytest.skip(f"the native stack does not run here: {native_unavailable_reason()}")
    paths = _paths(_version(ATEN_CPU_CAPABILITY="default"))
    assert paths["int4"].startswith("torch (DEFAULT)") and "layout" in paths["int4"], paths
    assert paths["int8"].startswith("native ("), paths
