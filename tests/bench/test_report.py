"""Results document and report from hand-made runs (no model): schema, Markdown, plots, last line."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from polylane.bench import harness, metrics, report, workloads
from polylane.bench.systems import SystemSettings


class _Stub:
    transport = "worker"


def _timelines(phase: workloads.Phase, scale: float) -> list[metrics.RequestTimeline]:
    out = []
    for i, request in enumerate(phase.requests):
        sent = request.arrival_s
        first = sent + 0.2 * scale
        last = first + 0.05 * scale * (request.max_tokens - 1)
        out.append(
            metrics.RequestTimeline(
                request.request_id, request.model, request.category, sent, first, last, 50, 16 * (i % 2),
                request.max_tokens, "length",
            )
        )  # fmt: skip
    return out


@pytest.fixture
def results() -> dict:
    options = workloads.WorkloadOptions(models=("a", "b"), requests=6, max_tokens=8, rate=2.0)
    config = harness.BenchConfig(
        "mix",
        options,
        SystemSettings(models=(("a", "src-a"), ("b", "src-b"))),
        baselines=("plain", "per-process"),
        repeats=2,
        command="polylane bench mix --requests 6",
    )
    workload = workloads.build("mix", options, 0)
    [phase] = workload.phases
    runs: dict = {}
    timelines: dict = {}
    for name, scale in (("polylane", 1.0), ("plain", 1.5), ("per-process", 2.0)):
        runs[name] = []
        for repeat in range(2):
            made = _timelines(phase, scale * (1 + 0.1 * repeat))
            counters = metrics.EngineCounters(
                decode_steps=20, switches=3, decode_tokens=40, lane_steps={"a": 15, "b": 5}
            )
            summary = metrics.summarise(made, None if name == "per-process" else counters)
            runs[name].append(
                {"repeat": repeat, "position": 0, "load_seconds": 1.0, "phases": {"mix": summary}}
            )
            timelines[name] = {"mix": [t.to_dict() for t in made]}
    systems = {name: _Stub() for name in runs}
    return harness.assemble(config, workload, runs, timelines, systems, ([0.5, 0.4, 0.3], [1.0, 0.9, 0.8]))


def test_results_match_the_schema_and_carry_ratios(results: dict) -> None:
    jsonschema.validate(results, report.schema())
    polylane = results["systems"]["polylane"]["summary"]["mix"]
    plain = results["systems"]["plain"]["summary"]["mix"]
    ratio = results["systems"]["plain"]["ratio"]["mix"]
    assert ratio["throughput_tokens_per_s"] == pytest.approx(
        polylane["throughput_tokens_per_s"] / plain["throughput_tokens_per_s"]
    )
    assert ratio["ttft_p50_s"] == pytest.approx(plain["ttft_p50_s"] / polylane["ttft_p50_s"])
    assert ratio["ttft_p50_s"] > 1, "plain was made slower, so polylane's ratio is above 1"
    assert results["systems"]["polylane"]["ratio"] is None
    assert polylane["engine"]["lane_share"] == {"a": 0.75, "b": 0.25}
    assert results["systems"]["per-process"]["summary"]["mix"]["engine"] is None
    assert results["speculation"]["mix"]["acceptance_rate"] is None


def test_schema_rejects_a_broken_document(results: dict) -> None:
    broken = json.loads(json.dumps(results))
    del broken["systems"]["plain"]["summary"]["mix"]["ttft_p50_s"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, report.schema())


def test_report_writes_json_markdown_plots_and_a_json_last_line(results: dict, tmp_path: Path) -> None:
    paths = report.write(results, tmp_path)
    assert json.loads(paths["json"].read_text()) == results
    text = paths["markdown"].read_text()
    assert "| polylane |" in text and "| plain |" in text and "polylane ÷ baseline" in text
    for name in report.PLOTS:
        data = paths[name].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, f"{name}: {len(data)} bytes"
    line = report.final_line(results, tmp_path)
    assert "\n" not in line
    document = json.loads(line)
    assert document["workload"] == "mix"
    assert document["ratios"]["plain"]["mix"]["throughput_tokens_per_s"] > 1


def test_rebuild_recomputes_medians_and_ratios_from_the_runs(results: dict) -> None:
    stale = json.loads(json.dumps(results))
    for system in stale["systems"].values():
        system["summary"] = {}
        system.pop("paired_ratio")
    stale["speculation"] = {}
    assert harness.rebuild(stale) == json.loads(json.dumps(results))
