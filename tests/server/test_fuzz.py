"""Fuzzing a live server with hypothesis: random JSON bodies shaped after the request models (right
and wrong types, out-of-range numbers, unknown fields), junk bodies, random paths and methods, and
admin calls with random names and budgets. Never a 5xx but the deadline's 503 (a valid request that
asks for many tokens runs past the short deadline here); errors always in OpenAI's shape; the
engine alive, no reservation or KV block leaked, and a normal request served afterwards.

The server here has a tiny default max_tokens and a short deadline, so a random request that is
valid runs for a fraction of a second whatever it asks for."""

from __future__ import annotations

import json
import string
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from polylane.server.config import Limits
from tests.server.conftest import (
    GEMMA,
    SMOL,
    LiveServer,
    assert_error,
    sse_events,
    start_server,
    wait_blocks_free,
    wait_until,
)

FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
MODELS = (SMOL, GEMMA)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    # a lone surrogate: a valid JSON escape, never text a tokenizer can encode
    | st.text(st.characters() | st.characters(categories=["Cs"]), min_size=1, max_size=8)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


out_of_range = st.integers(-(10**12), 10**12) | st.floats() | st.sampled_from([-1, 0, 10**40, -(10**40)])
wild = json_values | out_of_range
text = st.text(max_size=24)
nonempty = st.text(min_size=1, max_size=24)

# field → a valid value (edges included); a body mixes them with wild values of any JSON type
SAMPLING = {
    "max_tokens": st.integers(1, 3) | st.none(),
    "temperature": st.floats(0, 2) | st.sampled_from([0, 2, 1e-300, 5e-324]),
    "top_p": st.floats(0, 1, exclude_min=True) | st.just(1),
    "top_k": st.integers(-1, 70_000),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**63 - 1) | st.none(),
    "stop": nonempty | st.lists(nonempty, max_size=4) | st.none(),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | st.none(),
    "ignore_eos": st.booleans(),
    "priority": st.integers(-100, 100),
    "user": text,
    "logprobs": st.sampled_from([None, False, True, 0, 2]),
    "top_logprobs": st.sampled_from([None, 0, 3]),
    "echo": st.sampled_from([None, False]),
    "presence_penalty": st.sampled_from([None, 0]),
    "frequency_penalty": st.sampled_from([None, 0.0]),
    "logit_bias": st.sampled_from([None, {}, {"15": 2.0}, {"15": -100}]),
    "best_of": st.sampled_from([None, 1]),
    "response_format": st.sampled_from([None, {"type": "text"}, {"type": "json_object"}]),
    "guided_choice": st.sampled_from([None, ["yes", "no"]]),
}
PROMPT = (
    st.text(min_size=1, max_size=40)
    | st.lists(st.integers(0, 40_000), min_size=1, max_size=12)
    | st.lists(nonempty, min_size=1, max_size=1)
)
PART = st.fixed_dictionaries({"type": st.just("text"), "text": text})
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer"]),
        "content": nonempty | st.lists(PART, min_size=1, max_size=3),
    },
    optional={"name": text},
)
MESSAGES = st.lists(MESSAGE, min_size=1, max_size=3)
EXTRA_KEYS = st.text(min_size=1, max_size=12).filter(
    lambda k: k not in SAMPLING and k not in ("prompt", "messages")
)


@st.composite
def bodies(draw: Any, required: dict[str, st.SearchStrategy[Any]], chat: bool) -> dict[str, Any]:
    """Valid bodies half the time; else one field (or many) replaced by a wild value or dropped."""
    optional = dict(SAMPLING)
    if chat:
        optional["max_completion_tokens"] = SAMPLING["max_tokens"]
    chosen = draw(st.sets(st.sampled_from(sorted(optional)), max_size=7))
    fields = {**required, **{name: optional[name] for name in chosen}}
    body = {name: draw(strategy) for name, strategy in fields.items()}
    mode = draw(st.sampled_from(["valid"] * 5 + ["one"] * 4 + ["many"]))
    if mode != "valid":
        keys = sorted(body)
        victims = [draw(st.sampled_from(keys))] if mode == "one" else draw(st.lists(st.sampled_from(keys)))
        for key in victims:
            if draw(st.integers(0, 5)) == 0:
                body.pop(key, None)
            else:
                body[key] = draw(wild)
    if draw(st.integers(0, 3)) == 0:  # unknown fields are ignored, as OpenAI's clients send some
        body.update(draw(st.dictionaries(EXTRA_KEYS, json_values, max_size=2)))
    return body


completion_bodies = bodies(
    {"model": st.sampled_from([*MODELS, *MODELS, *MODELS, "gpt-4o"]), "prompt": PROMPT}, chat=False
)
chat_bodies = bodies(
    {"model": st.sampled_from([SMOL] * 6 + [GEMMA, "nope"]), "messages": MESSAGES}, chat=True
)


@pytest.fixture(scope="module")
def live():
    limits = Limits(max_tokens_default=3, request_timeout_s=2.0, max_body_bytes=64 * 1024)
    # no output is compared here: the models load in place (dtype auto, `serve`'s default), about
    # 1 s each, where fp32 read or dequantised them (the admin fuzz evicts them; they load again)
    server = start_server(MODELS, limits=limits, kv_tokens=512, dtype="auto")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def http(live: LiveServer):
    with live.client(timeout=60) as client:
        yield client


def _check(response: httpx.Response) -> None:
    deadline = response.status_code == 503 and response.json()["error"]["code"] == "request_timeout"
    assert response.status_code < 500 or deadline, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert_error(response, response.status_code)
        assert len(response.content) < 2000, response.text[:300]


def _post(http: httpx.Client, path: str, body: Any) -> None:
    data = json.dumps(body).encode()  # NaN and Infinity as Python writes them: more to refuse
    headers = {"Content-Type": "application/json"}
    with http.stream("POST", path, content=data, headers=headers) as response:
        event(f"status {response.status_code}")
        if response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream"):
            events = list(sse_events(response.iter_lines()))
            assert events and events[-1] == "[DONE]", events[-3:]
            for chunk in events[:-1]:
                assert "error" not in chunk or chunk["error"]["type"] != "server_error", chunk
            return
        response.read()
    _check(response)
    if response.status_code >= 400:
        error = response.json()["error"]
        event(f"param {error['param']}: {error['message'][:60]}")
    if response.status_code == 200:
        choices = response.json()["choices"]
        assert choices and all(c["finish_reason"] in ("stop", "length") for c in choices), choices


@settings(FUZZ, max_examples=60)
@given(body=completion_bodies)
def test_fuzz_completions(http, body):
    _post(http, "/v1/completions", body)


@settings(FUZZ, max_examples=60)
@given(body=chat_bodies)
def test_fuzz_chat_completions(http, body):
    _post(http, "/v1/chat/completions", body)


junk_paths = st.text(alphabet=string.printable + "éß☃\u0000", max_size=40)
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
known = st.sampled_from(
    [
        "v1/completions",
        "v1/chat/completions",
        "v1/models",
        "admin/models",
        "admin/budget",
        "metrics",
        "health",
    ]
)


@settings(FUZZ, max_examples=100)
@given(
    method=methods,
    path=known | junk_paths,
    content=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()),
    content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
)
def test_fuzz_junk_bodies_paths_and_methods(http, method, path, content, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    send = content if method not in ("GET", "HEAD", "OPTIONS") else None
    response = http.request(method, "/" + quote(path, safe="/"), content=send, headers=headers)
    assert response.status_code < 500, (method, path, response.status_code, response.text[:300])
    if response.status_code >= 400 and method != "HEAD":
        assert_error(response, response.status_code)


names = st.sampled_from(MODELS) | st.text(max_size=40) | st.sampled_from(["..", "%2e%2e", "/etc/passwd", ""])
actions = st.sampled_from(["pin", "unpin", "evict", "evict?force=true", "evict?force=maybe", "load"])


@settings(FUZZ, max_examples=60)
@given(
    name=names,
    action=actions,
    budget=st.integers(-10, 2**52) | st.sampled_from([8 * 2**30, 2**30]) | wild,
    extra_field=st.booleans(),
)
def test_fuzz_admin_names_and_budgets(http, live, name, action, budget, extra_field):
    if action == "load" and name in MODELS:
        name = name + "-missing"  # loading a real model takes seconds; its path is tested in test_admin
    response = http.post(f"/admin/models/{quote(name, safe='')}/{action}")
    assert response.status_code < 500, (name, action, response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert_error(response, response.status_code)
    body = {"bytes": budget, **({"unexpected": 1} if extra_field else {})}
    response = http.post(
        "/admin/budget", content=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    _check(response)
    if extra_field:
        assert response.status_code == 400
    assert live.engine.alive


def test_after_fuzzing_the_engine_is_alive_and_nothing_leaked(http, live):
    for name in MODELS:
        assert http.post(f"/admin/models/{name}/unpin").status_code == 200
    assert http.post("/admin/budget", json={"bytes": 8 * 2**30}).status_code == 200
    wait_until(lambda: live.state.admission.requests == 0, what="admission to drain")
    assert live.state.admission.tokens == 0
    wait_blocks_free(live.state)
    for name in MODELS:  # a model evicted by a fuzzed budget reloads first: past the 2 s deadline, a 503
        body = {"model": name, "prompt": "Hello", "max_tokens": 2}
        wait_until(
            lambda body=body: http.post("/v1/completions", json=body).status_code == 200,
            timeout=60,
            what=name,
        )
    assert http.get("/health").status_code == 200
    stats = live.engine.stats()
    assert stats.max_concurrent_decode <= 1
    assert live.engine.alive
