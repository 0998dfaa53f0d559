"""`polylane serve --eviction` (and a config file's `eviction`) reaches the residency pool, and
`GET /admin/budget` says which policy runs; an unknown policy stops the start with its choices."""

from __future__ import annotations

import subprocess
import sys

import pytest

from polylane.policy.residency.eviction import EVICTION_POLICIES
from tests.server.conftest import SMOL, start_server


@pytest.mark.parametrize("eviction", list(EVICTION_POLICIES))
def test_the_pool_runs_the_eviction_policy_the_server_was_given(eviction):
    live = start_server((SMOL,), eviction=eviction)
    try:
        with live.client() as http:
            shown = http.get("/admin/budget")
        assert shown.status_code == 200, shown.text
        assert shown.json() == {"budget_bytes": live.engine.manager.budget_bytes, "eviction": eviction}
    finally:
        live.stop()


def _serve(args: list[str], cwd) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "polylane.cli", "serve", "--budget", "1GiB", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_an_unknown_eviction_flag_is_refused_with_the_choices(tmp_path):
    done = _serve(["--eviction", "lfu"], tmp_path)
    assert done.returncode == 2
    assert "argument --eviction: invalid choice: 'lfu'" in done.stderr  # argparse names the choices after it
    assert "lru" in done.stderr.split("'lfu'")[-1] and "cost" in done.stderr.split("'lfu'")[-1]


def test_an_unknown_eviction_in_the_config_file_is_refused_with_the_choices(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text('eviction = "lfu"\n')
    done = _serve(["--config", str(config)], tmp_path)
    assert done.returncode == 2
    assert "eviction must be one of lru, cost, got 'lfu'" in done.stderr
