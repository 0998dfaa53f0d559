"""The reliability harness, shortened (`polylane.bench.soak`; the full run is `python bench/soak.py`):
a real server with two good models (the budget shrunk under them by the admin faults), three
broken model files, clients that disconnect, admin faults while streams run, load/unload cycles and a SIGTERM
while a model loads. Nothing is lost, nothing is a 5xx, no KV block stays held, and the server
exits with status 0."""

from __future__ import annotations

from polylane.bench.soak import GOOD_MODELS, SoakOptions, run_soak
from tests.conftest import fetch_or_skip


def test_a_short_soak_loses_nothing(tmp_path):
    for name in GOOD_MODELS[:2]:
        fetch_or_skip(name)
    models = GOOD_MODELS[:2]  # (the full run's third model adds loads, not cases: the suite is kept short)
    options = SoakOptions(
        clients=4, seconds=4, models=models, admin_every_s=1, cycles=1, disconnect=0.3, workdir=tmp_path
    )
    report = run_soak(options)
    outcomes = report["outcomes"]
    context = f"{outcomes}, lost: {report['lost_details']}"
    assert outcomes["lost"] == 0 and outcomes["5xx"] == 0, context
    assert outcomes["ok"] >= 1, context
    assert report["idle_after"], "requests were still queued long after the clients stopped"
    assert all(held == 0 for held in report["kv_held_after"].values()), report["kv_blocks_after"]
    assert not any(key.endswith(("500", "502", "503")) for key in report["admin"]), report["admin"]
    assert report["sigterm"]["exit_code"] == 0, report["sigterm"]
    assert report["sigterm"]["request"] in ("ok", "503"), report["sigterm"]
    assert len(report["rss_cycles_mib"]) == len(models)
