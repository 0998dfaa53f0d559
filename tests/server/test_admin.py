"""Admin routes on a live server: list, load, pin, unpin, evict (pinned → 409, force works; busy →
409), set the budget (below the pinned footprint → 409 with the pool unchanged; a shrink evicts the
LRU unpinned model), unknown names → 404; `/metrics` carries the residency, lane, latency and
eviction series and the lane invariant (max concurrent decode 1)."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import GEMMA, SMOL, LiveServer, assert_error, start_server, wait_until


@pytest.fixture(scope="module")
def live():
    server = start_server((SMOL, GEMMA), kv_tokens=512)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def http(live: LiveServer):
    with live.client() as client:
        yield client


def _models(http) -> dict[str, dict]:
    response = http.get("/admin/models")
    assert response.status_code == 200, response.text
    return {m["id"]: m for m in response.json()["data"]}


def _idle(http, name: str) -> None:
    """The engine gives its lease back at the step after a request ends; wait for that."""
    wait_until(lambda: _models(http)[name]["in_flight"] == 0, timeout=10, what=f"{name} to be idle")


def _metrics(http) -> dict[str, list]:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {}
    for family in text_string_to_metric_families(response.text):
        families[family.name] = family.samples
    return families


def _value(samples: list, name: str, **labels: str) -> float:
    matching = [
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matching) == 1, (name, labels, samples)
    return matching[0]


def test_listing_shows_every_model_cold_at_first(http):
    models = _models(http)
    assert set(models) == {SMOL, GEMMA}
    assert all(m["state"] == "cold" and m["in_flight"] == 0 and not m["pinned"] for m in models.values())


def test_load_pin_unpin_evict(http, live):
    before = _models(http)[SMOL]
    assert before["bytes_estimated"] and before["max_context"] == 512 < before["model_context"]
    loaded = http.post(f"/admin/models/{SMOL}/load")
    assert loaded.status_code == 200, loaded.text
    assert not loaded.json()["bytes_estimated"] and loaded.json()["max_context"] == 512
    assert abs(loaded.json()["bytes"] - before["bytes"]) < 0.1 * before["bytes"], (before, loaded.json())
    assert loaded.json()["id"] == SMOL and loaded.json()["state"] == "resident"
    assert loaded.json()["bytes"] > 100 * 2**20
    assert loaded.json()["in_flight"] == 0
    lease = next(info for info in live.engine.manager.snapshot() if info.name == SMOL)
    assert lease.in_flight == 0, "the load's lease was not given back"

    pinned = http.post(f"/admin/models/{SMOL}/pin")
    assert pinned.status_code == 200 and pinned.json()["pinned"] is True
    refused = http.post(f"/admin/models/{SMOL}/evict")
    assert_error(refused, 409, code="residency_refused")
    assert "pinned" in refused.json()["error"]["message"]
    assert _models(http)[SMOL]["state"] == "resident", "a refused eviction changed something"

    forced = http.post(f"/admin/models/{SMOL}/evict", params={"force": "true"})
    assert forced.status_code == 200, forced.text
    assert forced.json()["state"] == "cold"
    assert_error(http.post(f"/admin/models/{SMOL}/evict", params={"force": "maybe"}), 400, param="force")
    assert_error(http.post(f"/admin/models/{SMOL}/evict"), 409)  # not resident any more

    unpinned = http.post(f"/admin/models/{SMOL}/unpin")
    assert unpinned.status_code == 200 and unpinned.json()["pinned"] is False

    # a completion loads it again; once idle, a plain evict works
    response = http.post("/v1/completions", json={"model": SMOL, "prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200, response.text
    _idle(http, SMOL)
    evicted = http.post(f"/admin/models/{SMOL}/evict")
    assert evicted.status_code == 200 and evicted.json()["state"] == "cold"
    assert live.engine.manager._pool.handle(SMOL) is None, "the evicted model is still held"


def test_a_model_with_a_request_in_flight_is_not_evicted(http, live):
    body = {
        "model": SMOL,
        "prompt": "Tell a long story.",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # decoding now
        for force in ("false", "true"):
            busy = http.post(f"/admin/models/{SMOL}/evict", params={"force": force})
            assert_error(busy, 409, code="residency_refused")
            assert "in flight" in busy.json()["error"]["message"]
    _idle(http, SMOL)  # leaving the stream aborted the request and gave the lease back
    assert _models(http)[SMOL]["state"] == "resident"


def test_in_flight_counts_requests_not_leases(http, live):
    # four of these fit the 512-token KV reservation together, and outlast the four stream openings
    body = {
        "model": SMOL,
        "prompt": "Tell a long story.",
        "max_tokens": 100,
        "ignore_eos": True,
        "stream": True,
    }
    readers = []  # kept: a dropped line iterator closes its connection, which aborts the request
    with contextlib.ExitStack() as streams:
        for _ in range(4):
            response = streams.enter_context(http.stream("POST", "/v1/completions", json=body))
            readers.append(response.iter_lines())
            next(line for line in readers[-1] if line.startswith("data: "))  # decoding now
        assert _models(http)[SMOL]["in_flight"] == 4
        metrics = http.get("/metrics").text
        assert f'polylane_model_in_flight{{model="{SMOL}"}} 4.0' in metrics
    _idle(http, SMOL)  # leaving the streams aborted the requests


def test_budget_below_the_pinned_footprint_is_refused_and_changes_nothing(http, live):
    for name in (SMOL, GEMMA):
        assert http.post(f"/admin/models/{name}/load").status_code == 200
    assert http.post(f"/admin/models/{SMOL}/pin").status_code == 200
    before = _models(http)
    budget = live.engine.manager.budget_bytes
    refused = http.post("/admin/budget", json={"bytes": before[SMOL]["bytes"] // 2})
    assert_error(refused, 409, code="residency_refused")
    assert live.engine.manager.budget_bytes == budget, "a refused budget changed the budget"
    after = _models(http)
    assert {n: (m["state"], m["bytes"]) for n, m in after.items()} == {
        n: (m["state"], m["bytes"]) for n, m in before.items()
    }

    fits_smol = before[SMOL]["bytes"] + 2**20
    shrunk = http.post("/admin/budget", json={"bytes": fits_smol})
    assert shrunk.status_code == 200, shrunk.text
    assert shrunk.json() == {"budget_bytes": fits_smol, "evicted": [GEMMA]}
    states = {n: m["state"] for n, m in _models(http).items()}
    assert states == {SMOL: "resident", GEMMA: "cold"}

    # with the budget too small for GEMMA, a request for it fails cleanly (503), SMOL keeps serving
    failed = http.post("/v1/completions", json={"model": GEMMA, "prompt": "Hi", "max_tokens": 1})
    assert_error(failed, 503)
    ok = http.post("/v1/completions", json={"model": SMOL, "prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200, ok.text

    grown = http.post("/admin/budget", json={"bytes": 8 * 2**30})
    assert grown.status_code == 200 and grown.json()["evicted"] == []
    assert http.post(f"/admin/models/{SMOL}/unpin").status_code == 200
    again = http.post("/v1/completions", json={"model": GEMMA, "prompt": "Hi", "max_tokens": 1})
    assert again.status_code == 200, again.text


@pytest.mark.parametrize("action", ["load", "pin", "unpin", "evict"])
@pytest.mark.parametrize("name", ["nope", "..", "%2Fetc%2Fpasswd", "x" * 300])
def test_unknown_model_is_404(http, action, name):
    response = http.post(f"/admin/models/{name}/{action}")
    if name == "..":  # the client folds the dot segment: that path is simply not a route
        assert_error(response, 404)
        return
    error = assert_error(response, 404)
    if response.json()["error"]["code"] != "route_not_found":  # routed: the registry refused the name
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert SMOL in error["message"] and GEMMA in error["message"]
        assert "x" * 120 not in error["message"]


def test_budget_body_is_validated(http, live):
    bad = (
        {"bytes": -1},
        {"bytes": "lots"},
        {"bytes": 2**60},
        {"bytes": "2PiB"},
        {},
        {"bytes": 10, "extra": 1},
    )
    coerced = ({"bytes": False}, {"bytes": True}, {"bytes": 1e9})  # no type coercion
    for body in bad + coerced:
        assert_error(http.post("/admin/budget", json=body), 400)
    before = live.engine.manager.budget_bytes
    try:  # a size as the command line takes it
        for size, expected in (("9GiB", 9 * 2**30), ("9.5G", 9_500_000_000), (f"{before + 1}", before + 1)):
            assert http.post("/admin/budget", json={"bytes": size}).json()["budget_bytes"] == expected
    finally:
        assert http.post("/admin/budget", json={"bytes": before}).status_code == 200


def _total(families: dict[str, list], family: str, sample: str, **labels: str) -> float:
    """A counter's value, 0 before its first increment (no sample yet)."""
    values = [
        s.value
        for s in families.get(family, [])
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(values)


def test_metrics(http, live):
    """Counters checked against the responses' usage after real traffic; the gauges and histograms
    are there and say what happened."""
    long_prompt = "Once upon a time, in a land of rivers and hills, there lived a fox. " * 4
    before = _metrics(http)
    usages: dict[str, list[dict]] = {SMOL: [], GEMMA: []}

    def ask(name: str, prompt: str) -> None:
        body = {"model": name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        usages[name].append(response.json()["usage"])

    # traffic on both models, concurrently, so the lane is shared and TTFT is observed; then the
    # same long prompt again, which its first run left in the prefix cache
    threads = [threading.Thread(target=ask, args=(name, long_prompt)) for name in (SMOL, GEMMA, SMOL)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ask(SMOL, long_prompt)
    families = _metrics(http)
    for name in (
        "polylane_model_state",
        "polylane_model_bytes",
        "polylane_ttft_seconds",
        "polylane_tpot_seconds",
        "polylane_e2e_seconds",
        "polylane_queue_seconds",
        "polylane_evictions",
        "polylane_max_concurrent_decode",
        "polylane_requests_finished",
        "polylane_requests_running",
        "polylane_requests_waiting",
        "polylane_queue_requests",
        "polylane_kv_blocks",
    ):
        assert name in families, sorted(families)
    assert usages[SMOL][-1]["prompt_tokens_details"]["cached_tokens"] > 0, usages[SMOL]
    for model, answers in usages.items():
        for counter, field in (
            ("polylane_prompt_tokens", "prompt_tokens"),
            ("polylane_completion_tokens", "completion_tokens"),
            ("polylane_prefix_hit_tokens", None),
        ):
            grew = _total(families, counter, f"{counter}_total", model=model) - _total(
                before, counter, f"{counter}_total", model=model
            )
            expected = sum(
                u[field] if field else u["prompt_tokens_details"]["cached_tokens"] for u in answers
            )
            assert grew == expected, (model, counter, grew, expected)
        for histogram in ("polylane_ttft_seconds", "polylane_e2e_seconds", "polylane_queue_seconds"):
            count = f"{histogram}_count"
            grew = _total(families, histogram, count, model=model) - _total(
                before, histogram, count, model=model
            )
            assert grew == len(answers), (model, histogram, grew)
        assert _value(families["polylane_requests_running"], "polylane_requests_running", model=model) == 0
        assert _value(families["polylane_requests_waiting"], "polylane_requests_waiting", model=model) == 0
        assert _value(families["polylane_lane_steps"], "polylane_lane_steps_total", model=model) >= 1
    route = {"route": "/v1/completions", "status": "200"}
    responses = _total(families, "polylane_http_responses", "polylane_http_responses_total", **route)
    assert (
        responses - _total(before, "polylane_http_responses", "polylane_http_responses_total", **route) == 4
    )
    state = families["polylane_model_state"]
    for model in (SMOL, GEMMA):
        assert _value(state, "polylane_model_state", model=model, state="resident") == 1
        assert _value(state, "polylane_model_state", model=model, state="cold") == 0
    evictions = families["polylane_evictions"]
    assert _value(evictions, "polylane_evictions_total", cause="explicit") >= 2
    assert _value(evictions, "polylane_evictions_total", cause="budget") >= 1
    assert _value(families["polylane_max_concurrent_decode"], "polylane_max_concurrent_decode") == 1
    threads = _value(families["polylane_compute_threads"], "polylane_compute_threads")
    ceiling = _value(families["polylane_compute_threads_max"], "polylane_compute_threads_max")
    assert 1 <= threads <= ceiling <= len(os.sched_getaffinity(0))
    assert _value(families["polylane_other_cpu_load"], "polylane_other_cpu_load") >= 0
    assert _value(families["polylane_process_cpu_seconds"], "polylane_process_cpu_seconds_total") > 0
    assert all(s.name.startswith("polylane_") for samples in families.values() for s in samples)


def test_kv_blocks_on_metrics_follow_a_request(http, live):
    def blocks() -> dict[str, float]:
        samples = _metrics(http)["polylane_kv_blocks"]
        uses = ("held", "cached", "free")
        return {use: _value(samples, "polylane_kv_blocks", model=SMOL, use=use) for use in uses}

    prompt = "Count slowly from one to one hundred, one number per line: " * 8
    body = {"model": SMOL, "prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # decoding now
        during = blocks()
        for _ in lines:
            pass
    _idle(http, SMOL)
    after = blocks()
    total = 512 // 16  # kv_tokens / block size
    assert sum(during.values()) == sum(after.values()) == total, (during, after)
    assert during["held"] >= 1, during  # the request's own blocks (its prompt's full blocks are cached)
    assert after["held"] == 0 and after["cached"] >= len(prompt) // 4 // 16, after
    usage = _value(_metrics(http)["polylane_kv_usage"], "polylane_kv_usage", model=SMOL)
    assert usage == 0, usage
