"""`polylane serve` fails fast (a real process): a port in use ends it before any model loads, and a
first model that cannot load (a budget below its size) ends it with status 2 and its reason in one
line, instead of a server that answers 503 to everything."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.conftest import fetch_or_skip
from tests.server.conftest import SMOL


def _serve(*args: str, cwd) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "polylane.cli", "serve", SMOL, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)


def test_a_port_in_use_fails_before_any_model_loads(tmp_path):
    fetch_or_skip(SMOL)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve("--port", str(port), cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert (
        lines[-1]
        == f"error: cannot listen on 127.0.0.1:{port}: the port is in use (choose another with --port)"
    )
    assert not any("loading" in line for line in lines), done.stderr[-2000:]


def test_a_budget_below_the_first_model_exits_with_its_reason(tmp_path):
    fetch_or_skip(SMOL)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    done = _serve("--port", str(port), "--budget", "100MB", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {SMOL} cannot load: "), last
    assert "larger than the whole budget" in last and "budget 100000000 bytes" in last, last
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def test_a_pinned_model_that_cannot_fit_fails_the_start_too(tmp_path):
    """Pinned models load at start (resident from the first request on); one larger than the budget
    ends the start with its reason, after the first model loaded."""
    fetch_or_skip(SMOL)
    fetch_or_skip("gemma3-270m")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    done = _serve(
        "gemma3-270m", "--pin", "gemma3-270m", "--port", str(port), "--budget", "250MB", cwd=tmp_path
    )
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: gemma3-270m cannot load: ") and "larger than the whole budget" in last, (
        last
    )
    assert f"loaded {SMOL} " in done.stderr, "the first model loads before the pinned one"
