"""Bad input against a live server: each case gets its 4xx status, OpenAI's error shape, the field
named in `param`, never a 5xx and never the input echoed back; after the whole table the engine
still serves a normal request and /health is 200."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from polylane.runtime.sampling.tokenizer import ChatTemplateError
from tests.server.conftest import GEMMA, QWEN, SMOL, LiveServer, assert_error

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
JUNK = "q7Zx" * 1250  # 5,000 characters that must never come back
MESSAGES = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class Case:
    id: str
    path: str
    body: Any  # a JSON value, or bytes sent as they are
    status: int
    param: Any = ...  # ... = not checked
    code: Any = ...  # ... = not checked
    says: tuple[str, ...] = ()  # substrings the message must contain


def _c(**fields: Any) -> dict[str, Any]:
    return {"model": SMOL, "prompt": "Hello", "max_tokens": 4, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": SMOL, "messages": MESSAGES, "max_tokens": 4, **fields}


def _raw(body: dict[str, Any]) -> bytes:
    """The body as bytes, each "@" replaced by the escape of a lone surrogate."""
    return json.dumps(body).replace("@", "\\ud800").encode()


CASES = [
    # unknown model: 404 listing what is served
    Case(
        "unknown-model", COMPLETIONS, _c(model="gpt-4"), 404, "model", "model_not_found", (SMOL, GEMMA, QWEN)
    ),
    Case("unknown-model-chat", CHAT, _chat(model="nope"), 404, "model", "model_not_found", (SMOL,)),
    Case("model-as-path", COMPLETIONS, _c(model="../../etc/passwd"), 404, "model", "model_not_found"),
    Case("model-empty", COMPLETIONS, _c(model=""), 400, "model"),
    Case("model-missing", COMPLETIONS, {"prompt": "hi"}, 400, "model"),
    # wrong types
    Case("temperature-str", COMPLETIONS, _c(temperature="hot"), 400, "temperature"),
    Case("max_tokens-str", COMPLETIONS, _c(max_tokens="ten"), 400, "max_tokens"),
    Case("max_tokens-float", COMPLETIONS, _c(max_tokens=2.5), 400, "max_tokens"),
    Case("prompt-int", COMPLETIONS, _c(prompt=5), 400, "prompt"),
    Case("prompt-dict", COMPLETIONS, _c(prompt={"text": "hi"}), 400, "prompt"),
    Case("prompt-missing", COMPLETIONS, {"model": SMOL}, 400, "prompt"),
    Case("messages-str", CHAT, _chat(messages="hi"), 400, "messages"),
    Case("messages-dict", CHAT, _chat(messages={"role": "user"}), 400, "messages"),
    Case("message-role", CHAT, _chat(messages=[{"role": "robot", "content": "hi"}]), 400, "messages.0.role"),
    Case(
        "message-content-int",
        CHAT,
        _chat(messages=[{"role": "user", "content": 5}]),
        400,
        "messages.0.content",
    ),
    Case("stream-str", COMPLETIONS, _c(stream="yes please"), 400, "stream"),
    # no coercion across JSON types: each would change what the request means
    Case("prompt-mixed-batch", COMPLETIONS, _c(prompt=["12", 34]), 400, "prompt"),
    Case("prompt-bools", COMPLETIONS, _c(prompt=[True, False]), 400, "prompt"),
    Case("prompt-floats", COMPLETIONS, _c(prompt=[1.0, 2.0]), 400, "prompt"),
    Case("max_tokens-digit-string", COMPLETIONS, _c(max_tokens="1"), 400, "max_tokens"),
    Case("max_tokens-bool", COMPLETIONS, _c(max_tokens=True), 400, "max_tokens"),
    Case("max_tokens-whole-float", CHAT, _chat(max_tokens=4.0), 400, "max_tokens"),
    Case("n-bool", COMPLETIONS, _c(n=True), 400, "n"),
    Case("stream-false-string", COMPLETIONS, _c(stream="false"), 400, "stream"),
    Case("stream-zero", CHAT, _chat(stream=0), 400, "stream"),
    Case("seed-digit-string", COMPLETIONS, _c(seed="7"), 400, "seed"),
    Case("temperature-digit-string", CHAT, _chat(temperature="0"), 400, "temperature"),
    Case("temperature-bool", COMPLETIONS, _c(temperature=False), 400, "temperature"),
    Case("ignore_eos-string", COMPLETIONS, _c(ignore_eos="true"), 400, "ignore_eos"),
    Case(
        "include_usage-int",
        CHAT,
        _chat(stream=True, stream_options={"include_usage": 1}),
        400,
        "stream_options.include_usage",
    ),
    Case("priority-string", COMPLETIONS, _c(priority="5"), 400, "priority"),
    Case("stop-int", COMPLETIONS, _c(stop=7), 400, "stop"),
    Case("body-list", COMPLETIONS, [1, 2, 3], 400, None),
    Case("body-null", COMPLETIONS, b"null", 400, None),
    Case("body-empty", COMPLETIONS, b"", 400),
    # out of range
    Case("temperature-neg", COMPLETIONS, _c(temperature=-1), 400, "temperature"),
    Case("temperature-3", COMPLETIONS, _c(temperature=3), 400, "temperature"),
    Case("top_p-0", COMPLETIONS, _c(top_p=0), 400, "top_p"),
    Case("top_p-1.5", COMPLETIONS, _c(top_p=1.5), 400, "top_p"),
    Case("min_p-2", CHAT, _chat(min_p=2), 400, "min_p"),
    Case("top_k-neg", COMPLETIONS, _c(top_k=-5), 400, "top_k"),
    Case("seed-neg", COMPLETIONS, _c(seed=-1), 400, "seed"),
    Case("max_tokens-0", COMPLETIONS, _c(max_tokens=0), 400, "max_tokens"),
    Case("max_completion_tokens-0", CHAT, _chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    Case("n-0", COMPLETIONS, _c(n=0), 400, "n"),
    Case("n-over-cap", COMPLETIONS, _c(n=5), 400, "n", ..., ("at most 4",)),
    Case("n-huge", CHAT, _chat(n=10**40), 400, "n"),
    Case("max_tokens-huge", COMPLETIONS, _c(max_tokens=10**40), 400, "max_tokens"),
    Case("stop-too-many", COMPLETIONS, _c(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    Case("stop-empty", COMPLETIONS, _c(stop=[""]), 400, "stop"),
    # empty input
    Case("prompt-empty", COMPLETIONS, _c(prompt=""), 400, "prompt"),
    Case("prompt-empty-list", COMPLETIONS, _c(prompt=[]), 400, "prompt"),
    Case("prompt-batch-over-32", COMPLETIONS, _c(prompt=["a"] * 33), 400, "prompt"),
    Case("prompt-batch-empty-ids", COMPLETIONS, _c(prompt=[[1, 2], []]), 400, "prompt"),
    Case("prompt-batch-empty-string", COMPLETIONS, _c(prompt=["a", ""]), 400, "prompt"),
    Case("messages-empty", CHAT, _chat(messages=[]), 400, "messages"),
    Case("messages-all-empty", CHAT, _chat(messages=[{"role": "user", "content": ""}]), 400, "messages"),
    # over the context: the message carries both counts
    Case(
        "max_tokens-over-context",
        COMPLETIONS,
        _c(max_tokens=2000),
        400,
        "max_tokens",
        "context_length_exceeded",
        ("2000", "1024"),
    ),
    Case(
        "max_tokens-far-over-context",
        COMPLETIONS,
        _c(max_tokens=5_000_000),
        400,
        "max_tokens",
        "context_length_exceeded",
        ("5000000", "1024"),
    ),
    Case(
        "chat-over-context",
        CHAT,
        _chat(max_completion_tokens=4000),
        400,
        "max_completion_tokens",
        "context_length_exceeded",
        ("4000", "1024"),
    ),
    Case(
        "prompt-over-context",
        COMPLETIONS,
        _c(prompt=[1] * 1500),
        400,
        "prompt",
        "context_length_exceeded",
        ("1500", "1024"),
    ),
    Case(
        "prompt-over-context-with-max_tokens",
        COMPLETIONS,
        _c(prompt=[1] * 1100, max_tokens=4),
        400,
        "prompt",
        "context_length_exceeded",
        ("1100", "1024"),
    ),
    # token ids
    Case("token-id-out-of-vocab", COMPLETIONS, _c(prompt=[1, 2, 10**9]), 400, "prompt", ..., ("1000000000",)),
    Case("token-id-negative", COMPLETIONS, _c(prompt=[1, -3]), 400, "prompt"),
    # huge numbers are refused by range, never echoed
    Case("token-id-huge", COMPLETIONS, _c(prompt=[1, 10**40]), 400, "prompt"),
    Case("top_k-huge", COMPLETIONS, _c(top_k=10**40), 400, "top_k"),
    # lone surrogates are valid JSON escapes but not text any tokenizer can encode
    Case(
        "surrogate-content",
        CHAT,
        _raw(_chat(messages=[{"role": "user", "content": "@"}])),
        400,
        "messages.0.content",
    ),
    Case(
        "surrogate-content-part",
        CHAT,
        _raw(_chat(messages=[{"role": "user", "content": [{"type": "text", "text": "@"}]}])),
        400,
        "messages.0.content",
    ),
    Case("surrogate-stop", COMPLETIONS, _raw(_c(stop=["ok", "@"])), 400, "stop"),
    Case("surrogate-prompt", COMPLETIONS, _raw(_c(prompt="a@b")), 400, "prompt"),
    Case("surrogate-model", COMPLETIONS, _raw(_c(model="@")), 400, "model"),
    # bodies
    Case("invalid-json", COMPLETIONS, b'{"model": "x", "prompt": ', 400, None, "invalid_json"),
    Case("not-utf8", CHAT, b"\xff\xfe\x00garbage", 400, None, "invalid_json"),
    Case("oversized-body", COMPLETIONS, _c(prompt="a" * (1 << 20)), 413, None, "body_too_large"),
    # a base model is completion-only
    Case(
        "chat-on-base-model",
        CHAT,
        _chat(model=GEMMA),
        400,
        "messages",
        "no_chat_template",
        ("completion-only",),
    ),
    # defined by OpenAI, not implemented: refused, not ignored
    Case("logprobs-bool", COMPLETIONS, _c(logprobs=True), 400, "logprobs"),
    Case("chat-logprobs-int", CHAT, _chat(logprobs=3), 400, "logprobs"),
    Case("presence_penalty", COMPLETIONS, _c(presence_penalty=0.5), 400, "presence_penalty"),
    Case("frequency_penalty", CHAT, _chat(frequency_penalty=1), 400, "frequency_penalty"),
    Case("echo", COMPLETIONS, _c(echo=True), 400, "echo"),
    Case("tools", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    Case("best_of", COMPLETIONS, _c(best_of=3), 400, "best_of"),
    Case("tool_choice-required", CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    Case(
        "tool_choice-named",
        CHAT,
        _chat(tool_choice={"type": "function", "function": {"name": "f"}}),
        400,
        "tool_choice",
    ),
    Case("grammar", COMPLETIONS, _c(grammar='root ::= "yes" | "no"'), 400, "grammar"),
    Case("guided_grammar", COMPLETIONS, _c(guided_grammar='root ::= "a"'), 400, "guided_grammar"),
    # structured outputs that cannot be enforced (tests/server/test_structured_outputs.py has more)
    Case("json_schema-not-object", CHAT, _chat(json_schema=["type", "object"]), 400, "json_schema"),
    Case("guided_choice-empty", COMPLETIONS, _c(guided_choice=[]), 400, "guided_choice"),
    Case("guided_regex-lookbehind", COMPLETIONS, _c(guided_regex="(?<=a)b"), 400, "guided_regex"),
    Case("response_format-xml", CHAT, _chat(response_format={"type": "xml"}), 400, "response_format.type"),
    # long junk in fields: refused without echoing it
    Case("junk-model", COMPLETIONS, _c(model=JUNK), 400, "model"),
    Case("junk-temperature", COMPLETIONS, _c(temperature=JUNK), 400, "temperature"),
    Case("junk-max_tokens", COMPLETIONS, _c(max_tokens=JUNK), 400, "max_tokens"),
    Case("junk-stop", COMPLETIONS, _c(stop=[JUNK]), 400, "stop"),
    Case("junk-user", COMPLETIONS, _c(user=JUNK), 400, "user"),
    Case("junk-logprobs", COMPLETIONS, _c(logprobs=JUNK), 400, "logprobs"),
    Case("junk-role", CHAT, _chat(messages=[{"role": JUNK, "content": "hi"}]), 400, "messages.0.role"),
    Case("junk-prompt-tokens", COMPLETIONS, _c(prompt=[JUNK]), 400, "prompt", "context_length_exceeded"),
    Case(
        "junk-prompt-over-context", COMPLETIONS, _c(prompt=JUNK * 3), 400, "prompt", "context_length_exceeded"
    ),
    Case(
        "junk-chat-on-base",
        CHAT,
        _chat(model=GEMMA, messages=[{"role": "user", "content": JUNK}]),
        400,
        "messages",
        "no_chat_template",
    ),
    Case("junk-body", COMPLETIONS, JUNK.encode(), 400, None, "invalid_json"),
    Case("junk-unknown-model-chat", CHAT, _chat(model=JUNK[:250]), 404, "model", "model_not_found"),
]


def _send(http: httpx.Client, case: Case) -> httpx.Response:
    if isinstance(case.body, bytes):
        return http.post(case.path, content=case.body, headers={"Content-Type": "application/json"})
    return http.post(case.path, json=case.body)


@pytest.fixture(scope="module")
def live(shared_server: LiveServer) -> LiveServer:
    return shared_server


@pytest.fixture(scope="module")
def http(live: LiveServer):
    with live.client(timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def before(live: LiveServer) -> int:
    return sum(m.requests for m in live.engine.stats().models.values())


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_its_status_and_error_shape(http, live, before, case):
    response = _send(http, case)
    error = assert_error(response, case.status, param=case.param, code=case.code)
    for text in case.says:
        assert text in error["message"], error
    assert len(response.content) < 1000, f"{len(response.content)}-byte error body: {response.text[:300]}"
    # a name may be quoted, cut to 100 characters; never more of the input than that
    assert JUNK[:120] not in response.text, "the error echoed the input back"
    assert live.engine.alive


def test_no_bad_request_reached_the_engine(live, before):
    """Every case above is refused before anything is submitted."""
    assert sum(m.requests for m in live.engine.stats().models.values()) == before


def test_after_the_table_a_normal_request_succeeds_and_health_is_ok(http, live):
    response = http.post(COMPLETIONS, json=_c(max_tokens=3, temperature=0))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] >= 1
    chat = http.post(CHAT, json=_chat(model=QWEN, max_tokens=2))
    assert chat.status_code == 200, chat.text
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert live.engine.alive
    assert live.state.admission.requests == 0 and live.state.admission.tokens == 0, "reservations leaked"


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1e-300},  # logits / temperature must not overflow to inf and NaN
        {"temperature": 5e-324},
        {"temperature": 1e-30},
        {"temperature": 2, "top_p": 1e-300},
        {"temperature": 2, "min_p": 1},
        {"temperature": 2, "top_k": 2**31 - 1},
        {"temperature": 1, "top_k": 1},
        {"temperature": 1, "seed": 2**63 - 1, "n": 4},
        {"stop": ["\u00e9", "\U0001f600", "\n"]},
        {"prompt": "\u0000"},
        {"prompt": [0]},
        {"tool_choice": "none", "parallel_tool_calls": False},  # no tools: plain text honours them
        {"tool_choice": "auto", "parallel_tool_calls": True},
    ],
    ids=lambda f: ",".join(f"{k}={v!r}"[:30] for k, v in f.items()),
)
def test_extreme_but_valid_values_are_served(http, live, fields):
    for model in (SMOL, GEMMA):
        response = http.post(COMPLETIONS, json=_c(model=model, max_tokens=2, **fields))
        assert response.status_code == 200, response.text
        assert all(c["finish_reason"] in ("stop", "length") for c in response.json()["choices"])
    assert live.engine.alive, live.engine.error


def test_an_oversized_body_without_content_length_is_413(http, live):
    """A chunked upload has no Content-Length: the limit is counted while it arrives."""
    limit = live.state.limits.max_body_bytes

    def chunks():
        yield b'{"model": "' + SMOL.encode() + b'", "prompt": "'
        for _ in range(limit // 4096 + 2):
            yield b"a" * 4096
        yield b'"}'

    for path in (COMPLETIONS, CHAT, "/admin/budget"):
        response = http.post(path, content=chunks(), headers={"Content-Type": "application/json"})
        assert_error(response, 413, code="body_too_large")
    small = http.post(
        COMPLETIONS,
        content=iter([json.dumps(_c(max_tokens=1)).encode()]),
        headers={"Content-Type": "application/json"},
    )
    assert small.status_code == 200, small.text


def test_a_template_that_refuses_the_messages_is_a_400_that_says_so(http, live, monkeypatch):
    """A model with a chat template whose rendering fails is not called "a base model"."""

    def refuse(*args, **kwargs):
        raise ChatTemplateError("the model's chat template failed: Conversation roles must alternate")

    monkeypatch.setattr(live.engine, "prompt_ids", refuse)
    error = assert_error(http.post(CHAT, json=_chat()), 400, param="messages", code="chat_template_error")
    assert "alternate" in error["message"] and "base model" not in error["message"]


@pytest.mark.parametrize("model", [SMOL, GEMMA])
def test_token_ids_up_to_the_vocabulary_edge(http, live, model):
    vocab = live.engine.models[model].tokenizer.vocab_size
    refused = http.post(COMPLETIONS, json=_c(model=model, prompt=[2, vocab]))
    error = assert_error(refused, 400, param="prompt")
    assert str(vocab) in error["message"]
    accepted = http.post(COMPLETIONS, json=_c(model=model, prompt=[2, vocab - 1], max_tokens=1))
    assert accepted.status_code == 200, accepted.text


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/nothing-here", 404),
        ("GET", COMPLETIONS, 405),
        ("DELETE", "/v1/models", 405),
        ("POST", "/health", 405),
        ("GET", "/v1/completions/../../etc/passwd", 404),
    ],
)
def test_unknown_routes_and_methods_get_the_error_shape(http, method, path, status):
    assert_error(http.request(method, path), status)
