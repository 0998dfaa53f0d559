"""Many clients at once against a live server with three models: 32 streaming clients, about a third
of them hanging up mid-stream; every kept stream completes, every request is accounted for (the
gone ones aborted), all KV blocks come back, and one model decodes at a time. A non-streaming
client that gives up is aborted too."""

from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import (
    ALL_MODELS,
    SMOL,
    LiveServer,
    finished_counts,
    kv_of,
    sse_events,
    total_finished,
    total_submitted,
    wait_blocks_free,
    wait_until,
)

CLIENTS = 32
KEPT_TOKENS = 8
GONE_TOKENS = 200  # far more than a dropped stream runs before its abort lands
TOPICS = [
    "the sea",
    "a mountain",
    "the city at night",
    "an old library",
    "a red bicycle",
    "winter",
    "the moon",
    "a lighthouse",
    "coffee",
    "a thunderstorm",
    "a garden",
    "trains",
]


@pytest.fixture(scope="module")
def live(shared_server: LiveServer) -> LiveServer:
    return shared_server


def _body(index: int, gone: bool) -> dict:
    model = ALL_MODELS[index % len(ALL_MODELS)]
    return {
        "model": model,
        "prompt": f"Client {index} writes one sentence about {TOPICS[index % len(TOPICS)]}:",
        "max_tokens": GONE_TOKENS if gone else KEPT_TOKENS,
        "ignore_eos": gone,
        "temperature": 0.7,
        "seed": index,
        "stream": True,
    }


def _client(live: LiveServer, index: int, gone: bool, start: threading.Barrier) -> dict:
    start.wait()
    with (
        httpx.Client(base_url=live.base_url, timeout=300) as http,
        http.stream("POST", "/v1/completions", json=_body(index, gone)) as response,
    ):
        assert response.status_code == 200, response.read()[:300]
        lines = response.iter_lines()
        if gone:
            leave_after = (index // 3) % 3  # right after the headers, or after one or two chunks
            if leave_after:
                for seen, event in enumerate(sse_events(lines), start=1):
                    assert event != "[DONE]", f"client {index}: the stream ended before its client left"
                    if seen == leave_after:
                        break
            return {"index": index, "gone": True}
        events = list(sse_events(lines))
    return {"index": index, "gone": False, "events": events}


def test_32_streaming_clients_over_three_models_some_leaving(live):
    state = live.state
    for model in ALL_MODELS:  # resident before the rush, so the clients measure serving, not loading
        with httpx.Client(base_url=live.base_url, timeout=120) as http:
            http.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 1})
    wait_blocks_free(state)
    submitted_before = total_submitted(state)
    finished_before = total_finished(state)
    aborted_before = total_finished(state, "abort")
    gone = {i for i in range(CLIENTS) if i % 3 == 1}

    start = threading.Barrier(CLIENTS)
    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(_client, live, i, i in gone, start) for i in range(CLIENTS)]
        results = [f.result(timeout=300) for f in futures]

    for result in results:
        if result["gone"]:
            continue
        events = result["events"]
        assert events[-1] == "[DONE]", f"client {result['index']}: no [DONE] ({events[-2:]})"
        assert events.count("[DONE]") == 1
        chunks = events[:-1]
        assert chunks, f"client {result['index']}: no chunk"
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert reasons in (["length"], ["stop"]), (result["index"], reasons)
        assert all("error" not in c for c in chunks)

    wait_until(
        lambda: total_finished(state) - finished_before == CLIENTS,
        timeout=60,
        what=f"all {CLIENTS} requests to finish ({finished_counts(state)})",
    )
    assert total_submitted(state) - submitted_before == CLIENTS, "a request was lost or doubled"
    assert total_finished(state, "abort") - aborted_before == len(gone), finished_counts(state)
    wait_blocks_free(state)
    wait_until(lambda: state.admission.requests == 0, timeout=10, what="admission to drain")
    assert state.admission.tokens == 0
    stats = live.engine.stats()
    assert stats.max_concurrent_decode == 1
    assert all(stats.models[m].requests > 0 for m in ALL_MODELS)
    assert live.engine.alive


def test_a_non_streaming_client_that_gives_up_is_aborted_and_frees_its_blocks(live, caplog):
    state = live.state
    wait_blocks_free(state)
    aborted_before = total_finished(state, "abort")
    submitted_before = total_submitted(state)
    tokens_before = live.engine.stats().models[SMOL].output_tokens
    prompt = "Recite, slowly and in full, every number from one to a thousand, " * 6  # > 2 KV blocks
    body = {"model": SMOL, "prompt": prompt, "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=live.base_url, timeout=1.5) as http:
        http.post("/v1/completions", json=body)
    assert total_submitted(state) - submitted_before == 1
    wait_until(lambda: total_finished(state, "abort") - aborted_before == 1, timeout=10, what="the abort")
    gc.collect()  # asyncio reports an unseen exception when its future is collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], (
        "a traceback per disconnect"
    )
    assert live.engine.stats().models[SMOL].output_tokens - tokens_before < 900
    wait_blocks_free(state)
    wait_until(lambda: state.admission.requests == 0, timeout=10, what="admission to drain")
    prompt_ids = live.engine.prompt_ids(SMOL, prompt)
    assert len(prompt_ids) > 32
    kv = kv_of(state, SMOL)
    assert kv.tree.num_cached_tokens(prompt_ids) == 0, "an aborted request's KV entered the prefix cache"
    assert live.engine.alive
