"""Structured outputs composed with speculation, in the engine on a real model: with drafters (the
n-gram and the int4 twin) and the grammar's forced tokens verified in the same passes, greedy
output under a JSON schema is exactly plain constrained greedy decoding's, the forced tokens are
counted, and every output validates. A logit bias under speculation gives plain decoding's output
too (the verify rows are biased as the decode rows are), and logprobs come from the target's rows
as plain decoding's do."""

from __future__ import annotations

import json

import jsonschema
import torch

from polylane.engine import Engine, EngineConfig
from polylane.grammar_spec import grammar_for
from polylane.types import SamplingParams
from tests.conftest import fetch_or_skip

SMOL = "smollm2-135m-instruct"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "count": {"type": "integer"},
    },
    "required": ["name", "colours", "count"],
    "additionalProperties": False,
}
MESSAGES = [
    "Repeat this as JSON: name Ada, colours red, green, blue, red; count 4.",
    "Give me a JSON object about a painter and their favourite colours.",
]


def test_speculation_under_a_grammar_is_plain_constrained_greedy():
    fetch_or_skip(SMOL)
    grammar = grammar_for("json_schema", SCHEMA)
    speculation = {"drafters": ["ngram", "twin"], "adaptive": False, "max_draft_tokens": 4}
    # compared exactly: a fixed thread count (sums split over threads differ in order)
    with Engine(EngineConfig(budget_bytes=2 * 2**30, threads=torch.get_num_threads())) as engine:
        engine.add_model(SMOL, dtype="auto", kv_tokens=2048, speculation=speculation)
        messages = [[{"role": "user", "content": m}] for m in MESSAGES]
        plain = SamplingParams(max_tokens=80, grammar=grammar, speculation=False)
        reference = [engine.submit(SMOL, messages=m, params=plain).result(timeout=600) for m in messages]
        spec = SamplingParams(max_tokens=80, grammar=grammar)
        handles = [engine.submit(SMOL, messages=m, params=spec) for m in messages]  # batched together
        outputs = [h.result(timeout=600) for h in handles]
        for got, want in zip(outputs, reference, strict=True):
            assert want.finish_reason == "stop"
            jsonschema.validate(json.loads(want.text), SCHEMA)
            assert got.token_ids == want.token_ids, f"{got.text!r} != {want.text!r}"
        # sampled under the grammar: prompt lookup and forced tokens only; the output still validates
        sampled = SamplingParams(max_tokens=80, grammar=grammar, temperature=0.8, top_p=0.95)
        for handle in [engine.submit(SMOL, messages=m, params=sampled) for m in messages]:
            result = handle.result(timeout=600)
            assert result.finish_reason == "stop"
            jsonschema.validate(json.loads(result.text), SCHEMA)

        # a bias that bans the reference's most frequent token, with and without drafts
        ids = [t for r in reference for t in r.token_ids]
        ban = ((max(set(ids), key=ids.count), -100.0),)
        free = [[{"role": "user", "content": "Count from one to twenty in words, separated by commas."}]]
        want = engine.submit(
            SMOL, messages=free[0], params=SamplingParams(max_tokens=48, logit_bias=ban, speculation=False)
        )
        got = engine.submit(SMOL, messages=free[0], params=SamplingParams(max_tokens=48, logit_bias=ban))
        assert got.result(timeout=600).token_ids == want.result(timeout=600).token_ids
        assert ban[0][0] not in got.result(timeout=0).token_ids

        # logprobs of speculated tokens: from the target's verify rows, as plain decoding's
        ask = SamplingParams(max_tokens=32, logprobs=3)
        want = engine.submit(
            SMOL, messages=free[0], params=SamplingParams(max_tokens=32, logprobs=3, speculation=False)
        )
        got = engine.submit(SMOL, messages=free[0], params=ask).result(timeout=600)
        want = want.result(timeout=600)
        assert got.token_ids == want.token_ids and len(got.logprobs) == len(got.token_ids)
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert abs(a.logprob - b.logprob) < 1e-4

        stats = engine.stats()
        forced = stats.models[SMOL].forced_tokens
        assert forced > 0, "no grammar-forced token went through a verify pass"
        rounds = sum(p.rounds for p in stats.speculation)
        print(f"forced tokens {forced}, drafter rounds {rounds}")
