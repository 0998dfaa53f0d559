"""Every workload at tiny size on the real SmolLM2, through `polylane bench`, with a baseline each.

Each test runs the command in-process (the harness never imports torch; the systems run in worker
processes), then checks the results document against the schema, the plots, the last stdout line,
and behaviour: every request completes with exactly the tokens asked for, the decode lane is
observed to hold one model at a time, the prefix cache is hit only where it is on. Never speed.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from polylane.bench import report
from polylane.bench.cpu_hog import SPIN
from polylane.cli import main
from tests.conftest import fetch_or_skip

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module", autouse=True)
def _smollm2() -> None:
    fetch_or_skip(SMOL)


def bench(
    capsys: pytest.CaptureFixture[str], out: Path, *argv: str, kv_tokens: int = 1024
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run `polylane bench ARGV`; the results document (checked against the schema) and the
    last stdout line, parsed."""
    options = ["--out", str(out), "--repeats", "1", "--no-progress", "--timeout", "240"]
    code = main(["bench", *argv, *options, "--kv-tokens", str(kv_tokens)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    results = json.loads((out / "results.json").read_text())
    jsonschema.validate(results, report.schema())
    last = json.loads(captured.out.strip().splitlines()[-1])
    assert last["workload"] == results["workload"]
    assert (out / "results.md").read_text().startswith(f"# polylane bench `{results['workload']}`")
    for name in report.PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, f"{name}: {len(data)} bytes"
    for system, entry in results["systems"].items():
        for phase, summary in entry["summary"].items():
            assert summary["errors"] == 0, f"{system}/{phase}: {results['timelines'][system][phase]}"
            assert summary["completed"] == summary["requests"]
    return results, last


def test_single_with_plain_baseline(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    results, last = bench(
        capsys, tmp_path, "single", "--requests", "1", "--max-tokens", "4", "--prompt-tokens", "64",
        "--batch", "2", "--baseline", "plain",
    )  # fmt: skip
    assert [p["name"] for p in results["phases"]] == ["prefill", "decode", "batch-2"]
    for system in ("polylane", "plain"):
        summary = results["systems"][system]["summary"]
        assert summary["prefill"]["output_tokens"] == 1
        assert summary["prefill"]["prompt_tokens"] >= 40
        assert summary["decode"]["output_tokens"] == 4
        assert summary["batch-2"]["output_tokens"] == 8
        assert summary["prefill"]["prefill_tokens_per_s"] > 0
        assert summary["batch-2"]["engine"]["max_concurrent_decode"] == 1
    # The batch's chat prompts share the chat template's opening: cached with the prefix cache on.
    assert results["systems"]["polylane"]["summary"]["batch-2"]["cached_tokens"] > 0
    assert results["systems"]["plain"]["summary"]["batch-2"]["cached_tokens"] == 0
    ratio = results["systems"]["plain"]["ratio"]["decode"]["stream_decode_tokens_per_s"]
    assert ratio is not None and ratio > 0
    assert last["ratios"]["plain"]["prefill"]["prefill_tokens_per_s"] is not None


def test_mix_of_two_models_with_per_process_baseline(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    results, _ = bench(
        capsys, tmp_path, "mix", "--models", f"smol-a={SMOL}", f"smol-b={SMOL}", "--requests", "6",
        "--max-tokens", "4", "--rate", "0", "--concurrency", "6", "--zipf", "0", "--baseline", "per-process",
    )  # fmt: skip
    expected = sum(r["output_tokens"] for r in results["timelines"]["polylane"]["mix"])
    polylane = results["systems"]["polylane"]["summary"]["mix"]
    assert set(polylane["per_model"]) == {"smol-a", "smol-b"}, "uniform popularity drew only one model"
    engine = polylane["engine"]
    assert engine["max_concurrent_decode"] == 1, "the decode lane held two models at once"
    assert set(engine["lane_share"]) == {"smol-a", "smol-b"}
    assert sum(engine["lane_share"].values()) == pytest.approx(1.0)
    assert engine["residency_misses"] == 0, "models were loaded during the timed run"
    per_process = results["systems"]["per-process"]
    assert per_process["transport"] == "processes"
    assert per_process["summary"]["mix"]["output_tokens"] == expected
    assert per_process["summary"]["mix"]["engine"]["max_concurrent_decode"] is None
    assert per_process["ratio"]["mix"]["throughput_tokens_per_s"] > 0


def test_shared_prefix_requests_reuse_the_system_prompt(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    results, _ = bench(
        capsys, tmp_path, "shared-prefix", "--requests", "2", "--prefixes", "1", "--max-tokens", "3",
        "--rate", "0", "--concurrency", "1", "--baseline", "none", kv_tokens=2048,
    )  # fmt: skip
    # kv_tokens 2048: with 1024 the second request must evict the first one's cached blocks, and
    # the scheduler sometimes keeps a stale free-block count from before they became evictable, so
    # the request waits forever on an idle engine (seen about 1 run in 3; reported, engine side).
    assert list(results["systems"]) == ["polylane"]
    polylane = results["systems"]["polylane"]["summary"]["shared-prefix"]
    # The second request reuses the first one's system prompt (about 600 tokens).
    assert polylane["cached_tokens"] >= 400, polylane
    assert polylane["prefix_hit_rate"] > 0.3


def test_spec_with_ngram_chain_and_tree_against_transformers_lookup(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # adaptive off: every round with an n-gram match drafts, so the counters cannot stay empty
    speculation = json.dumps({"drafters": ["ngram"], "adaptive": False})
    results, last = bench(
        capsys, tmp_path, "spec", "--speculation", speculation, "--spec-mode", "chain", "tree",
        "--categories", "repetitive", "--requests", "1", "--max-tokens", "8",
        "--baseline", "transformers-lookup",
    )  # fmt: skip
    assert list(results["systems"]) == ["polylane", "polylane-tree", "transformers-lookup"]
    assert [p["name"] for p in results["phases"]] == ["repetitive"]
    spec = results["speculation"]["repetitive"]
    for system in ("polylane", "polylane-tree"):
        row = spec["systems"][system]
        assert row["verify_steps"] and row["drafted_tokens"], f"{system}: no speculation counted: {row}"
        assert 0 <= row["acceptance_rate"] <= 1 and row["tokens_per_verify"] >= 1
        assert row["speedup"]["transformers-lookup"] is not None
    assert spec["systems"]["polylane"]["tree_rounds"] == 0, "mode chain drafted a tree"
    outputs = {s: results["systems"][s]["summary"]["repetitive"]["output_tokens"] for s in results["systems"]}
    assert all(1 <= n <= 8 for n in outputs.values()), outputs
    assert results["systems"]["transformers-lookup"]["summary"]["repetitive"]["engine"] is None
    assert last["speculation"]["repetitive"]["acceptance_rate"] is not None


def test_cross_model_shared_prefix_imports_the_providers_prefix(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    results, last = bench(
        capsys, tmp_path, "shared-prefix", "--cross-model", "--models", SMOL, f"alias={SMOL}",
        "--requests", "1", "--prompt-tokens", "64", "--baseline", "none",
    )  # fmt: skip
    row = results["cross_model"]["alias"]["polylane"]
    assert row["cross_model"]["imported_tokens"] >= 32, row
    assert row["cross_model"]["hits"] == 1 and row["cross_model"]["layers_per_token"] == 30
    categories = results["systems"]["polylane"]["summary"]["alias"]["per_category"]
    assert {c: categories[c]["requests"] for c in categories} == {"provider": 1, "shared": 1, "cold": 1}
    assert row["shared_ttft_p50_s"] > 0 and row["cold_ttft_p50_s"] > 0
    assert last["cross_model"]["alias"]["polylane"]["speedup"] is not None


def _cmdline(process: Any) -> list[str]:
    """A process's arguments, or none when it ended (or cannot be read) in the meantime."""
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_single_against_a_running_server(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import uvicorn

    from polylane.server.app import build_state, create_app
    from polylane.server.config import ModelDecl, ServerConfig

    state = build_state(ServerConfig(models=(ModelDecl(SMOL, SMOL, kv_tokens=1024),), budget_bytes=8 * 2**30))
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        results, _ = bench(
            capsys, tmp_path, "single", "--url", f"http://127.0.0.1:{port}", "--requests", "1",
            "--max-tokens", "4", "--prompt-tokens", "64", "--batch", "2", "--baseline", "none",
        )  # fmt: skip
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    polylane = results["systems"]["polylane"]
    assert polylane["transport"] == "http"
    assert polylane["summary"]["decode"]["output_tokens"] == 4  # from the server's usage
    assert polylane["summary"]["batch-2"]["output_tokens"] == 8
    engine = polylane["summary"]["batch-2"]["engine"]
    assert engine is not None, "counters come from the server's /metrics"
    assert engine["decode_steps"] >= 3 and engine["max_concurrent_decode"] == 1


def test_single_under_a_busy_neighbour_runs_every_phase_twice(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--cpu-hog 1`: each phase again, after the idle ones, while a busy-loop process spins (other
    prompts, nothing cached from the idle twin), the idle/loaded block per system, and no spinner
    left behind."""
    import psutil

    results, last = bench(
        capsys, tmp_path, "single", "--requests", "1", "--max-tokens", "4", "--prompt-tokens", "64",
        "--batch", "2", "--baseline", "none", "--cpu-hog", "1",
    )  # fmt: skip
    names = [p["name"] for p in results["phases"]]
    assert names == ["prefill", "decode", "batch-2", "prefill+hog", "decode+hog", "batch-2+hog"]
    assert [p["primary_metric"] for p in results["phases"]][::3] == ["prefill_tokens_per_s"] * 2
    summary = results["systems"]["polylane"]["summary"]
    assert summary["decode+hog"]["output_tokens"] == 4 and summary["batch-2+hog"]["output_tokens"] == 8
    # other prompts: at most their common opening ("(ref " and the template) is served from the cache
    loaded_prefill = summary["prefill+hog"]
    assert loaded_prefill["cached_tokens"] <= 0.1 * loaded_prefill["prompt_tokens"], loaded_prefill
    block = results["cpu_hog"]
    assert set(block) == {"prefill+hog", "decode+hog", "batch-2+hog"}
    row = block["decode+hog"]["polylane"]
    assert row["metric"] == "stream_decode_tokens_per_s" and row["kept"] > 0
    assert row["kept"] == pytest.approx(row["loaded"] / row["idle"])
    assert last["cpu_hog"]["decode+hog"]["polylane"]["kept"] == row["kept"]
    assert "busy-loop process" in (tmp_path / "results.md").read_text()
    # the spinners are this process's children running exactly SPIN (a CI script that happens to
    # contain "while True" is not one of them)
    spinners = [p for p in psutil.Process().children(recursive=True) if SPIN in _cmdline(p)]
    assert not spinners, f"busy-loop processes outlived the bench: {[p.pid for p in spinners]}"
