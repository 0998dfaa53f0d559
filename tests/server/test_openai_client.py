"""The official `openai` client against a live server holding several models: completions and chat,
streaming and not; greedy output equal to the engine's own `generate`; usage; n; stop strings."""

from __future__ import annotations

import pytest

from polylane.types import SamplingParams
from tests.server.conftest import GEMMA, QWEN, SMOL, LiveServer, sse_events, wait_blocks_free

MAX_TOKENS = 8
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a primary colour."}]


@pytest.fixture(scope="module")
def live(shared_server: LiveServer) -> LiveServer:
    return shared_server


@pytest.fixture(scope="module")
def client(live: LiveServer):
    with live.openai(timeout=120) as client:
        yield client


def _engine_greedy(live: LiveServer, model: str, *, prompt: str | None = None, messages=None) -> str:
    """What the engine itself generates greedily for the same prompt ids (no HTTP)."""
    engine = live.engine
    ids = engine.prompt_ids(model, prompt, messages)
    completion = engine.generate(model, ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert completion.finish_reason in ("stop", "length"), completion
    return completion.text


def test_models_list_shows_every_served_model_with_state_and_bytes(client):
    client.completions.create(model=SMOL, prompt=PROMPT, max_tokens=1)  # SMOL resident now
    listed = {model.id: model.model_dump() for model in client.models.list()}
    assert set(listed) == {SMOL, GEMMA, QWEN}
    for model in listed.values():
        assert model["object"] == "model"
        assert model["state"] in ("cold", "loading", "resident"), model
        assert isinstance(model["bytes"], int) and model["bytes"] >= 0, model
        assert model["max_context"] > 0
    # measured once resident: weights + KV reservation (a cold model's bytes are not known yet)
    assert listed[SMOL]["state"] == "resident"
    assert listed[SMOL]["bytes"] > 100 * 2**20, listed[SMOL]
    assert listed[SMOL]["chat"] is True
    assert listed[GEMMA]["chat"] is False, "gemma3-270m is a base model: completion-only"


@pytest.mark.parametrize("model", [SMOL, GEMMA])
def test_completion_greedy_equals_engine_and_stream_equals_plain(client, live, model):
    expected = _engine_greedy(live, model, prompt=PROMPT)
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert response.object == "text_completion"
    assert response.model == model
    assert len(response.choices) == 1
    choice = response.choices[0]
    assert choice.text == expected
    assert choice.finish_reason in ("stop", "length")
    prompt_tokens = len(live.engine.prompt_ids(model, PROMPT))
    assert response.usage.prompt_tokens == prompt_tokens
    assert 1 <= response.usage.completion_tokens <= MAX_TOKENS
    assert response.usage.total_tokens == prompt_tokens + response.usage.completion_tokens
    if choice.finish_reason == "length":
        assert response.usage.completion_tokens == MAX_TOKENS

    chunks = list(
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
    )
    assert chunks, "no chunks streamed"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason], "exactly one chunk carries the finish reason"
    assert all(c.usage is None for c in chunks), "usage chunk sent without stream_options"


@pytest.mark.parametrize("model", [SMOL, QWEN])
def test_chat_greedy_equals_engine_and_stream_equals_plain(client, live, model):
    expected = _engine_greedy(live, model, messages=MESSAGES)
    response = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0
    )
    assert response.object == "chat.completion"
    message = response.choices[0].message
    assert message.role == "assistant"
    assert message.content == expected
    assert response.usage.prompt_tokens == len(live.engine.prompt_ids(model, messages=MESSAGES))
    assert response.usage.completion_tokens >= 1

    stream = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == expected
    assert content_chunks[-1].choices[0].finish_reason == response.choices[0].finish_reason
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1], "the usage chunk comes last"
    assert usage_chunks[0].choices == []
    assert usage_chunks[0].usage.completion_tokens == response.usage.completion_tokens
    assert usage_chunks[0].usage.prompt_tokens == response.usage.prompt_tokens


def test_completion_stream_with_usage(client, live):
    chunks = list(
        client.completions.create(
            model=SMOL,
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    text_tokens = len(live.engine.prompt_ids(SMOL, PROMPT))
    assert usage.prompt_tokens == text_tokens
    assert usage.completion_tokens == 4 or chunks[-2].choices[0].finish_reason == "stop"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_n_two_gives_two_choices(client, live):
    alone = live.engine.generate(SMOL, PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
    response = client.completions.create(model=SMOL, prompt=PROMPT, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [alone.text, alone.text], "greedy choices must agree"
    assert response.usage.completion_tokens == 2 * len(alone.token_ids), "usage counts both choices"
    assert response.usage.prompt_tokens == len(live.engine.prompt_ids(SMOL, PROMPT))

    stream = client.chat.completions.create(
        model=SMOL, messages=MESSAGES, max_tokens=4, temperature=0.8, seed=7, n=2, stream=True
    )
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in stream if c.choices[0].finish_reason}
    assert set(finished) == {0, 1}


def test_stop_string_ends_the_text_before_it(client, live):
    full = _engine_greedy(live, SMOL, prompt=PROMPT)
    words = full.split()
    assert len(words) >= 2, f"need a longer greedy continuation to pick a stop string from: {full!r}"
    stop = words[1]
    expected = full[: full.index(stop)]
    response = client.completions.create(
        model=SMOL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop, "zzzqqq"]
    )
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    streamed = list(
        client.completions.create(
            model=SMOL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_raw_sse_stream_is_openai_chunks_ending_with_done(live):
    body = {"model": GEMMA, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with live.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response.iter_lines()))
    assert events[-1] == "[DONE]"
    assert events.count("[DONE]") == 1
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["model"] == GEMMA for c in chunks)
    assert len({c["id"] for c in chunks}) == 1, "every chunk of one request carries the same id"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    wait_blocks_free(live.state)
