"""Metric arithmetic on hand-made timelines: percentiles, rates, ratios, summaries, medians."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from polylane.bench.metrics import (
    EngineCounters,
    RequestTimeline,
    SpeculationCounters,
    engine_summary,
    median_summary,
    merge_counters,
    paired_ratios,
    percentile,
    rate,
    ratio,
    ratios,
    summarise,
)


def timeline(
    request_id: str,
    sent: float,
    first: float | None,
    last: float | None,
    output: int,
    *,
    model: str = "a",
    prompt: int = 10,
    cached: int = 0,
    reason: str = "length",
) -> RequestTimeline:
    return RequestTimeline(request_id, model, "chat", sent, first, last, prompt, cached, output, reason)


def test_percentile_interpolates_linearly_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5  # halfway between the 2nd and 3rd
    assert percentile(values, 99) == pytest.approx(3.97)  # 3 + 0.97 × (4 − 3)
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_percentile_matches_numpy_linear() -> None:
    numpy = pytest.importorskip("numpy")
    values = [0.3, 1.7, 0.2, 9.1, 4.4, 4.4, 0.0, 2.5, 7.7]
    for q in (1, 10, 25, 50, 75, 90, 99):
        assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))


def test_rate_and_ratio() -> None:
    assert rate(30, 2.0) == 15.0
    assert rate(30, 0.0) is None
    assert ratio(20.0, 10.0, "higher") == 2.0  # twice the tokens/s
    assert ratio(0.1, 0.3, "lower") == pytest.approx(3.0)  # a third of the latency: 3× better
    assert ratio(None, 1.0, "higher") is None
    assert ratio(1.0, 0.0, "higher") is None
    assert ratio(0.0, 1.0, "lower") is None
    with pytest.raises(ValueError):
        ratio(1.0, 1.0, "faster")


def test_timeline_ttft_and_tpot() -> None:
    t = timeline("r", sent=1.0, first=1.5, last=3.5, output=5)
    assert t.ttft == pytest.approx(0.5)
    assert t.tpot == pytest.approx(0.5)  # 2 s over 4 tokens after the first
    assert timeline("one", 0.0, 0.2, 0.2, 1).tpot is None  # one token: no time per output token
    failed = timeline("x", 0.0, None, None, 0, reason="error")
    assert not failed.ok and failed.ttft is None and failed.tpot is None
    moved = t.shifted(10.0)
    assert (moved.sent, moved.first_token, moved.last_token) == (11.0, 11.5, 13.5)


def test_summary_of_hand_made_phase() -> None:
    # Two models; one request of b failed. Times in seconds from the phase start.
    timelines = [
        timeline("r1", 0.0, 1.0, 3.0, 5, prompt=100, cached=0),  # ttft 1.0, tpot 0.5
        timeline("r2", 1.0, 1.5, 2.5, 3, prompt=100, cached=60),  # ttft 0.5, tpot 0.5
        timeline("r3", 2.0, 4.0, 6.0, 9, model="b", prompt=40, cached=20),  # ttft 2.0, tpot 0.25
        timeline("r4", 2.0, None, None, 0, model="b", reason="error"),
    ]
    s = summarise(timelines)
    assert (s["requests"], s["completed"], s["errors"]) == (4, 3, 1)
    assert s["output_tokens"] == 17
    assert s["wall_seconds"] == pytest.approx(6.0)  # first send 0.0 → last token 6.0
    assert s["throughput_tokens_per_s"] == pytest.approx(17 / 6)
    assert s["requests_per_s"] == pytest.approx(3 / 6)
    assert s["ttft_p50_s"] == pytest.approx(1.0)
    assert s["ttft_p99_s"] == pytest.approx(1.0 + 0.98 * 1.0)  # between 1.0 and 2.0
    assert s["tpot_p50_s"] == pytest.approx(0.5)
    # prefill: (240 prompt − 80 cached) tokens over 3.5 s of ttft
    assert s["prefill_tokens_per_s"] == pytest.approx(160 / 3.5)
    # decode per stream: (4 + 2 + 8) tokens after the first over (2 + 1 + 2) s
    assert s["stream_decode_tokens_per_s"] == pytest.approx(14 / 5)
    # all streams: 14 tokens from the earliest first token (1.0) to the latest last (6.0)
    assert s["aggregate_decode_tokens_per_s"] == pytest.approx(14 / 5)
    assert s["prefix_hit_rate"] == pytest.approx(80 / 240)
    assert s["per_model"]["a"]["token_share"] == pytest.approx(8 / 17)
    assert s["per_model"]["b"]["requests"] == 2
    assert s["per_model"]["b"]["ttft_p50_s"] == pytest.approx(2.0)
    assert s["engine"] is None


def test_summary_of_an_empty_or_failed_phase_has_no_rates() -> None:
    s = summarise([timeline("x", 0.0, None, None, 0, reason="error")])
    assert s["completed"] == 0 and s["errors"] == 1
    assert s["throughput_tokens_per_s"] is None and s["ttft_p50_s"] is None
    assert s["prefix_hit_rate"] is None


def test_aggregate_decode_differs_from_per_stream_when_streams_overlap() -> None:
    # Two streams decoding at the same time: each sees 10 tok/s, together 20 tok/s.
    s = summarise([timeline("a", 0.0, 0.0, 1.0, 11), timeline("b", 0.0, 0.0, 1.0, 11)])
    assert s["stream_decode_tokens_per_s"] == pytest.approx(10.0)
    assert s["aggregate_decode_tokens_per_s"] == pytest.approx(20.0)


def test_engine_counters_delta_and_summary() -> None:
    before = EngineCounters(
        steps=10,
        decode_steps=8,
        switches=1,
        decode_tokens=8,
        lane_steps={"a": 8},
        max_concurrent_decode=1,
        residency_misses=2,
        page_in_seconds=3.0,
    )
    after = EngineCounters(
        steps=30,
        decode_steps=28,
        switches=6,
        decode_tokens=68,
        lane_steps={"a": 18, "b": 10},
        max_concurrent_decode=1,
        residency_hits=4,
        residency_misses=3,
        residency_evictions=1,
        page_in_seconds=4.5,
        speculation=SpeculationCounters(40, 30, 40, 10),
    )
    delta = after.delta(before)
    assert (delta.steps, delta.decode_steps, delta.switches) == (20, 20, 5)
    assert delta.lane_steps == {"a": 10, "b": 10}
    assert delta.residency_misses == 1 and delta.page_in_seconds == pytest.approx(1.5)
    summary = engine_summary(delta)
    assert summary["lane_share"] == {"a": 0.5, "b": 0.5}
    assert summary["decode_batch_mean"] == pytest.approx(3.0)
    assert summary["max_concurrent_decode"] == 1
    assert summary["speculation"]["acceptance_rate"] == pytest.approx(0.75)
    assert summary["speculation"]["tokens_per_verify"] == pytest.approx(4.0)
    assert EngineCounters.from_dict(after.to_dict()) == after


def test_speculation_and_cross_model_counters_over_a_phase() -> None:
    before = EngineCounters(
        speculation=SpeculationCounters(10, 5, 8, 3, chain_rounds=3, decisions_on=3),
        cross_model_hits={"sibling": 1},
        cross_model_tokens={"sibling": 64},
        cross_model_layer_tokens={"sibling": 64 * 15},
    )
    after = EngineCounters(
        speculation=SpeculationCounters(
            30, 20, 28, 8, chain_rounds=5, tree_rounds=3, decisions_on=8, decisions_off=4
        ),
        cross_model_hits={"sibling": 3, "alias": 1},
        cross_model_tokens={"sibling": 192, "alias": 64},
        cross_model_layer_tokens={"sibling": 192 * 15, "alias": 64 * 30},
    )
    delta = after.delta(before)
    assert delta.speculation == SpeculationCounters(20, 15, 20, 5, 2, 3, 5, 4)
    summary = engine_summary(delta)
    assert summary["speculation"]["tree_rounds"] == 3 and summary["speculation"]["decisions_off"] == 4
    assert summary["cross_model"] == {
        "alias": {"hits": 1, "imported_tokens": 64, "layers_per_token": 30.0},
        "sibling": {"hits": 2, "imported_tokens": 128, "layers_per_token": 15.0},
    }
    assert (
        engine_summary(EngineCounters(cross_model_tokens={"x": 16}))["cross_model"]["x"]["layers_per_token"]
        is None
    )
    assert engine_summary(EngineCounters())["cross_model"] is None
    assert EngineCounters.from_dict(after.to_dict()) == after
    merged = merge_counters([before, after])
    assert merged.speculation == SpeculationCounters(40, 25, 36, 11, 8, 3, 11, 4)
    assert merged.cross_model_tokens == {"sibling": 256, "alias": 64}


def test_per_category_summary() -> None:
    timelines = [
        RequestTimeline("p", "provider", "provider", 0.0, 4.0, 4.0, 2000, 0, 1, "length"),
        RequestTimeline("s", "sibling", "shared", 4.0, 6.0, 6.0, 2000, 0, 1, "length"),
        RequestTimeline("c", "sibling", "cold", 6.0, 10.0, 12.0, 2000, 0, 5, "length"),
    ]
    per_category = summarise(timelines)["per_category"]
    assert list(per_category) == ["provider", "shared", "cold"]
    assert per_category["shared"]["ttft_p50_s"] == pytest.approx(2.0)
    assert per_category["cold"]["ttft_p50_s"] == pytest.approx(4.0)
    assert per_category["cold"]["stream_decode_tokens_per_s"] == pytest.approx(2.0)
    assert per_category["shared"]["stream_decode_tokens_per_s"] is None
    assert per_category["provider"]["prompt_tokens"] == 2000 and per_category["cold"]["requests"] == 1


def test_merged_counters_of_separate_processes_observe_no_concurrency() -> None:
    a = EngineCounters(decode_steps=5, lane_steps={"a": 5}, max_concurrent_decode=1, residency_hits=1)
    b = EngineCounters(decode_steps=15, lane_steps={"b": 15}, max_concurrent_decode=1, residency_hits=2)
    merged = merge_counters([a, b])
    assert merged.decode_steps == 20 and merged.residency_hits == 3
    assert merged.lane_steps == {"a": 5, "b": 15}
    assert merged.max_concurrent_decode is None


def test_median_summary_and_ratios() -> None:
    runs = [
        {"throughput_tokens_per_s": 10.0, "ttft_p50_s": 0.3, "x": None, "nested": {"k": 1}, "name": "a"},
        {"throughput_tokens_per_s": 30.0, "ttft_p50_s": None, "x": None, "nested": {"k": 5}, "name": "a"},
        {"throughput_tokens_per_s": 20.0, "ttft_p50_s": 0.1, "x": None, "nested": {"k": 3, "j": 2}},
    ]
    median = median_summary(runs)
    assert median["throughput_tokens_per_s"] == 20.0
    assert median["ttft_p50_s"] == pytest.approx(0.2)  # None left out: median of 0.3 and 0.1
    assert median["x"] is None
    assert median["nested"] == {"k": 3, "j": 2}
    assert median["name"] == "a"
    ours = {"throughput_tokens_per_s": 20.0, "ttft_p50_s": 0.1, "tpot_p50_s": None}
    theirs = {"throughput_tokens_per_s": 10.0, "ttft_p50_s": 0.4, "tpot_p50_s": 0.2}
    r = ratios(ours, theirs)
    assert r["throughput_tokens_per_s"] == 2.0
    assert r["ttft_p50_s"] == pytest.approx(4.0)
    assert r["tpot_p50_s"] is None
    assert math.isfinite(r["throughput_tokens_per_s"])


@pytest.mark.parametrize(
    "module",
    [
        "polylane.bench.metrics",
        "polylane.bench.workloads",
        "polylane.bench.replay",
        "polylane.bench.systems",
        "polylane.bench.report",
        "polylane.bench.command",
    ],
)
def test_harness_side_never_imports_torch(module: str) -> None:
    code = f"import sys, {module}; print(','.join(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"importing {module} imported torch: {done.stdout[:200]}"


def test_paired_ratios_take_the_median_of_per_repeat_ratios() -> None:
    # Drift: the machine halves its speed in repeat 2, for both systems alike.
    ours = [
        {"throughput_tokens_per_s": 20.0},
        {"throughput_tokens_per_s": 10.0},
        {"throughput_tokens_per_s": 18.0},
    ]
    theirs = [
        {"throughput_tokens_per_s": 10.0},
        {"throughput_tokens_per_s": 5.0},
        {"throughput_tokens_per_s": 12.0},
    ]
    paired = paired_ratios(ours, theirs)
    assert paired["throughput_tokens_per_s"] == pytest.approx(2.0)  # median of 2.0, 2.0, 1.5
    assert paired["ttft_p50_s"] is None
