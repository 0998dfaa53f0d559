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


def _assembled(
    workload_name: str, options: workloads.WorkloadOptions, scales: dict, counters: dict, **kw
) -> dict:
    """Results of hand-made runs: each system's timelines scaled by `scales[name]` (a function of
    the request), engine counters `counters[name]` (None: no engine)."""
    config = harness.BenchConfig(
        workload_name,
        options,
        SystemSettings(models=tuple((m, f"src-{m}") for m in options.models), **kw.get("settings", {})),
        baselines=kw.get("baselines", ()),
        variants=kw.get("variants", ()),
        repeats=1,
    )
    workload = workloads.build(workload_name, options, 0)
    runs: dict = {}
    timelines: dict = {}
    for name, scale in scales.items():
        phases = {}
        timelines[name] = {}
        for phase in workload.phases:
            made = []
            for request in phase.requests:
                factor = scale(request)
                first = request.arrival_s + 0.2 * factor
                last = first + 0.05 * factor * (request.max_tokens - 1)
                made.append(
                    metrics.RequestTimeline(
                        request.request_id, request.model, request.category, request.arrival_s, first, last,
                        2000, 0, request.max_tokens, "length",
                    )
                )  # fmt: skip
            phases[phase.name] = metrics.summarise(made, counters.get(name))
            timelines[name][phase.name] = [t.to_dict() for t in made]
        runs[name] = [{"repeat": 0, "position": 0, "load_seconds": 1.0, "phases": phases}]
    stubs = {name: _Stub() for name in runs}
    return harness.assemble(config, workload, runs, timelines, stubs, ([0.5], [0.5]))


def test_spec_report_compares_every_speculating_system_with_every_baseline(tmp_path: Path) -> None:
    options = workloads.WorkloadOptions(models=("t",), requests=2, max_tokens=8)
    spec = metrics.SpeculationCounters(40, 30, 40, 10, chain_rounds=10, decisions_on=10, decisions_off=2)
    tree = metrics.SpeculationCounters(60, 30, 40, 10, tree_rounds=10)
    results = _assembled(
        "spec",
        options,
        {"polylane": lambda r: 1.0, "polylane-tree": lambda r: 1.25, "plain": lambda r: 2.0,
         "transformers-lookup": lambda r: 1.6},
        {"polylane": metrics.EngineCounters(speculation=spec),
         "polylane-tree": metrics.EngineCounters(speculation=tree), "plain": metrics.EngineCounters()},
        baselines=("plain", "transformers-lookup"),
        variants=("polylane-tree",),
        settings={"speculation": {"drafters": ["ngram"], "mode": "chain"}},
    )  # fmt: skip
    jsonschema.validate(results, report.schema())
    assert [p["name"] for p in results["phases"]] == ["code", "chat", "extraction"]
    assert all(p["primary_metric"] == "stream_decode_tokens_per_s" for p in results["phases"])
    assert results["systems"]["polylane-tree"]["role"] == "variant"
    code = results["speculation"]["code"]
    assert code["acceptance_rate"] == pytest.approx(0.75) and code["tokens_per_verify"] == pytest.approx(4.0)
    assert code["speedup"]["plain"] == pytest.approx(2.0)
    assert code["speedup"]["polylane-tree"] == pytest.approx(1.25)
    polylane, tree_row = code["systems"]["polylane"], code["systems"]["polylane-tree"]
    assert set(polylane["speedup"]) == {"plain", "transformers-lookup"}, (
        "speedups over non-speculating systems"
    )
    assert tree_row["speedup"]["plain"] == pytest.approx(1.6)
    assert tree_row["speedup_paired"]["transformers-lookup"] == pytest.approx(1.28)
    assert tree_row["acceptance_rate"] == pytest.approx(0.5) and tree_row["tree_rounds"] == 10
    assert polylane["decisions_off"] == 2
    text = report.write(results, tmp_path)["markdown"].read_text()
    assert "## Speculation" in text
    assert "| polylane-tree ÷ plain | 1.60× (1.60×) | 1.60× (1.60×) | 1.60× (1.60×) |" in text
    assert "| polylane | code | 0.75 | 4.00 | 40 | 10 | 10 / 0 | 10 / 2 |" in text
    assert json.loads(report.final_line(results, tmp_path))["speculation"]["chat"]["speedup"]["plain"] == 2.0


def test_cross_model_report_gives_consumer_ttft_shared_against_cold(tmp_path: Path) -> None:
    options = workloads.WorkloadOptions(
        models=("provider", "sibling", "alias"), requests=2, prompt_tokens=64, cross_model=True
    )

    def polylane(request: workloads.BenchRequest) -> float:  # shared prompts: half the sibling's time
        if request.category != "shared":
            return 1.0
        return 0.5 if request.model == "sibling" else 0.05

    counters = metrics.EngineCounters(
        cross_model_hits={"sibling": 2, "alias": 2},
        cross_model_tokens={"sibling": 96, "alias": 96},
        cross_model_layer_tokens={"sibling": 96 * 15, "alias": 96 * 30},
    )
    results = _assembled(
        "shared-prefix",
        options,
        {"polylane": polylane, "plain": lambda r: 1.1},
        {"polylane": counters, "plain": metrics.EngineCounters()},
        baselines=("plain",),
    )
    jsonschema.validate(results, report.schema())
    assert [p["name"] for p in results["phases"]] == ["sibling", "alias"]
    assert results["phases"][0]["primary_metric"] == "ttft_p50_s"
    sibling = results["cross_model"]["sibling"]["polylane"]
    assert sibling["speedup"] == pytest.approx(2.0) and sibling["vs_plain"] == pytest.approx(2.2)
    assert sibling["cross_model"] == {"hits": 2, "imported_tokens": 96, "layers_per_token": 15.0}
    assert results["cross_model"]["alias"]["polylane"]["speedup"] == pytest.approx(20.0)
    assert results["cross_model"]["alias"]["plain"]["speedup"] == pytest.approx(1.0)
    assert results["cross_model"]["alias"]["plain"]["cross_model"] is None
    paths = report.write(results, tmp_path)
    text = paths["markdown"].read_text()
    assert "## Prefill shared across models (provider: provider)" in text
    assert "| sibling | polylane | 100 | 200 | 2.00× | 2.20× | 200 | 2 | 96 | 15.0 |" in text
    assert paths["primary.png"].read_bytes()[:4] == b"\x89PNG"
    assert "cross_model" in json.loads(report.final_line(results, tmp_path))
    rebuilt = harness.rebuild(json.loads(json.dumps(results)))
    assert rebuilt["cross_model"] == json.loads(json.dumps(results["cross_model"]))
