"""`polylane --version`: the version, the torch build and which compute path each dtype gets on
this CPU (the native stack with its matrix kernel, or torch at its CPU capability, and why)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time

import pytest
import torch

from polylane.runtime.model.compute_paths import native_unavailable_reason
from polylane.runtime.model.native import stack as native
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
        if dtype in ("auto", "auto-fp32"):
            expected = "a GGUF file's own blocks in place"
        assert path.startswith(expected), f"{dtype}: {path}"


def test_without_the_native_stack_every_dtype_says_torch_and_why() -> None:
    paths = _paths(_version(POLYLANE_NATIVE="0"))
    assert all(
        path.startswith("torch (") and "turned off (POLYLANE_NATIVE=0)" in path for path in paths.values()
    )


def test_int4_packed_for_another_capability_runs_on_torch_and_says_so() -> None:
    if native.kernel_name() is None:
        pytest.skip(str(native_unavailable_reason()))
    paths = _paths(_version(ATEN_CPU_CAPABILITY="default"))
    assert paths["int4"].startswith("torch (DEFAULT)") and "layout" in paths["int4"], paths
    assert paths["int8"].startswith("native ("), paths


def test_serve_logs_the_block_and_runs_the_threads_it_was_given(tmp_path) -> None:
    """`polylane serve --threads 1`: the version block in the start log, one compute thread on
    /metrics (a fixed count), and a completion served."""
    import socket

    import httpx

    from tests.conftest import fetch_or_skip

    fetch_or_skip("smollm2-135m-instruct")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "polylane.cli", "serve", "--port", str(port), "--threads", "1"]
    with log.open("w") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 180
            while "serving" not in log.read_text():
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            base = f"http://127.0.0.1:{port}"
            _wait_for_health(base, deadline)
            text = log.read_text()
            assert "polylane: compute paths on this CPU:" in text and "polylane: threads: fixed at 1 " in text
            done = httpx.post(
                f"{base}/v1/completions",
                json={"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 4},
                timeout=120,
            )
            assert done.status_code == 200, done.text
            metrics = httpx.get(f"{base}/metrics", timeout=30).text
            assert "\npolylane_compute_threads 1.0\n" in metrics
            assert "\npolylane_compute_threads_max 1.0\n" in metrics
        finally:
            server.terminate()
            server.wait(timeout=60)


def _wait_for_health(base: str, deadline: float) -> None:
    import httpx

    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not answer /health"
        time.sleep(0.1)
