"""The OpenAI surface clients rely on, with the official `openai` client: `models.retrieve`,
`system_fingerprint`, the chunk shape of a streamed chat (a role-only first chunk, text chunks,
an empty delta carrying `finish_reason`), OpenAI's context-length message, CORS for browser
clients (`--allowed-origins`, off by default), batches of prompts and `logit_bias`."""

from __future__ import annotations

import math
import re

import httpx
import openai
import pytest

from tests.server.conftest import SMOL, start_server


def test_models_retrieve_answers_one_model_and_404_for_an_unknown_one(shared_client):
    model = shared_client.models.retrieve(SMOL)
    assert model.id == SMOL and model.object == "model"
    listed = {m.id: m for m in shared_client.models.list()}
    assert model.model_dump() == listed[SMOL].model_dump() | {
        "idle_seconds": model.model_dump()["idle_seconds"]
    }
    with pytest.raises(openai.NotFoundError) as raised:
        shared_client.models.retrieve("no-such-model")
    assert raised.value.body["code"] == "model_not_found"


def test_every_response_says_its_system_fingerprint(shared_client):
    done = shared_client.completions.create(model=SMOL, prompt="Hi", max_tokens=2, temperature=0)
    assert re.fullmatch(r"fp_polylane_[\w.+-]+", done.system_fingerprint)
    chunks = list(
        shared_client.completions.create(model=SMOL, prompt="Hi", max_tokens=2, temperature=0, stream=True)
    )
    assert chunks and all(c.system_fingerprint == done.system_fingerprint for c in chunks)


def test_a_streamed_chat_has_openais_chunk_shape(shared_client):
    messages = [{"role": "user", "content": "Name a primary colour."}]
    reply = shared_client.chat.completions.create(model=SMOL, messages=messages, max_tokens=6, temperature=0)
    chunks = list(
        shared_client.chat.completions.create(
            model=SMOL, messages=messages, max_tokens=6, temperature=0, stream=True
        )
    )
    deltas = [c.choices[0] for c in chunks]
    first, *middle, last = deltas
    assert first.delta.role == "assistant" and first.delta.content == "" and first.finish_reason is None
    assert middle and all(d.delta.content and d.finish_reason is None for d in middle), "text chunks"
    assert last.delta.content is None and last.delta.role is None, "the last chunk's delta is empty"
    assert last.finish_reason == reply.choices[0].finish_reason
    assert "".join(d.delta.content for d in middle) == reply.choices[0].message.content


def test_the_context_length_error_says_the_limit_and_the_request(shared_client, shared_server):
    limit = shared_server.engine.models[SMOL].max_request_tokens
    with pytest.raises(openai.BadRequestError) as raised:
        shared_client.completions.create(model=SMOL, prompt="Hi", max_tokens=limit)
    message = raised.value.body["message"]
    assert f"maximum context length is {limit} tokens" in message, message
    assert re.search(
        rf"you requested {limit + 1} tokens \(1 in the prompt, {limit} in the completion\)", message
    )
    assert raised.value.body["code"] == "context_length_exceeded"


def test_cors_is_off_by_default_and_answers_the_origins_allowed():
    server = start_server(
        (SMOL,), kv_tokens=256, api_key="sk-cors", allowed_origins=("http://localhost:3000",)
    )
    try:
        preflight = {
            "Origin": "http://localhost:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        answer = httpx.options(f"{server.base_url}/v1/chat/completions", headers=preflight, timeout=30)
        assert answer.status_code == 200, answer.text  # no API key on a preflight
        assert answer.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = httpx.options(
            f"{server.base_url}/v1/chat/completions",
            headers={**preflight, "Origin": "http://evil.example"},
            timeout=30,
        )
        assert "access-control-allow-origin" not in other.headers
        listed = httpx.get(
            f"{server.base_url}/v1/models",
            headers={"Origin": "http://localhost:3000", "Authorization": "Bearer sk-cors"},
            timeout=30,
        )
        assert (
            listed.status_code == 200
            and listed.headers["access-control-allow-origin"] == "http://localhost:3000"
        )
    finally:
        server.stop()


def test_without_allowed_origins_no_cors_header(shared_server):
    response = httpx.get(
        f"{shared_server.base_url}/v1/models", headers={"Origin": "http://localhost:3000"}, timeout=30
    )
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_a_batch_of_prompts_gets_n_choices_each_in_order(shared_client, shared_server):
    """`prompt` as a list of strings or of token lists: choice index = prompt × n + choice, each
    choice what its prompt alone gives (greedy), usage summed over the prompts."""
    texts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    alone = [
        shared_client.completions.create(model=SMOL, prompt=t, max_tokens=4, temperature=0) for t in texts
    ]
    batch = shared_client.completions.create(model=SMOL, prompt=texts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone) * 2
    tokenizer = shared_server.engine.models[SMOL].tokenizer
    ids = [tokenizer.encode(t) for t in texts[:2]]
    by_ids = shared_client.completions.create(model=SMOL, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone[:2]]
    streamed = list(
        shared_client.completions.create(model=SMOL, prompt=texts, max_tokens=4, temperature=0, stream=True)
    )
    text = {
        i: "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i)
        for i in range(3)
    }
    assert [text[i] for i in range(3)] == [a.choices[0].text for a in alone]


def test_logit_bias_bans_and_forces_tokens(shared_client, shared_server):
    tokenizer = shared_server.engine.models[SMOL].tokenizer

    def complete(**extra):
        return (
            shared_client.completions.create(
                model=SMOL, prompt="The capital of France is", max_tokens=4, temperature=0, **extra
            )
            .choices[0]
            .text
        )

    free = complete()
    first = tokenizer.encode(free, add_special_tokens=False)[0]
    banned = complete(logit_bias={str(first): -100})
    assert not banned.startswith(tokenizer.decode([first]))
    forced = tokenizer.encode(" zebra", add_special_tokens=False)[0]
    assert complete(logit_bias={str(forced): 100}) == tokenizer.decode([forced] * 4)


def test_logit_bias_out_of_range_or_not_a_token_id_is_a_400(shared_client):
    for bias, words in (({"99999999": 5}, "out of range"), ({"abc": 5}, "token ids"), ({"5": 101}, "100")):
        with pytest.raises(openai.BadRequestError) as caught:
            shared_client.completions.create(model=SMOL, prompt="hi", max_tokens=2, logit_bias=bias)
        assert words in caught.value.body["message"]


def test_chat_logprobs_are_the_greedy_distributions_top(shared_client):
    ask = {
        "model": SMOL,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
    }
    response = shared_client.chat.completions.create(**ask)
    choice = response.choices[0]
    content = choice.logprobs.content
    assert "".join(e.token for e in content) == choice.message.content
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 5 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert entry.token == tops[0].token and entry.logprob == tops[0].logprob  # greedy: the argmax
        assert sum(math.exp(t.logprob) for t in tops) <= 1.0 + 1e-5
        assert entry.bytes == list(entry.token.encode())
    streamed = shared_client.chat.completions.create(**ask, stream=True)
    pieces = [
        e
        for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in pieces] == [e.token for e in content]
    # (the server's thread count follows the machine's load: sums may round differently)
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(pieces, content, strict=True))


def test_sampled_logprobs_come_from_the_filtered_distribution(shared_client):
    response = shared_client.completions.create(
        model=SMOL,
        prompt="Once upon a time",
        max_tokens=10,
        temperature=0.7,
        logprobs=5,
        extra_body={"top_k": 3},
    )
    choice = response.choices[0]
    assert "".join(choice.logprobs.tokens) == choice.text
    assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens)
    assert choice.logprobs.text_offset[0] == 0
    for token, logprob, tops in zip(
        choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True
    ):
        assert 1 <= len(tops) <= 3  # only top_k's three tokens have probability
        assert abs(sum(math.exp(v) for v in tops.values()) - 1.0) < 1e-4  # renormalised over them
        assert tops[token] == logprob


def test_logprobs_fields_are_checked(shared_client):
    bad = (
        ({"top_logprobs": 3}, "logprobs"),  # chat: top_logprobs without logprobs
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    )
    for fields, param in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            shared_client.chat.completions.create(
                model=SMOL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **fields
            )
        assert param in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        shared_client.completions.create(
            model=SMOL, prompt="hi", max_tokens=2, extra_body={"top_logprobs": 2}
        )
