"""Structured outputs through the official `openai` client: `response_format` (json_object,
json_schema), llama.cpp's `json_schema` and vLLM's `guided_*`, on both endpoints, streamed too.

Each constrained output is parsed and validated against its schema (`jsonschema`). The small models
here do not write schema-valid JSON by themselves (the unconstrained control below), and a choice
of made-up words is never what a model says unasked, so these tests fail when the mask is skipped.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.conftest import fetch_or_skip
from tests.server.conftest import GEMMA, QWEN, SMOL, start_server

QWEN_LARGE = "qwen2.5-coder-1.5b-instruct"
INSTRUCT = (SMOL, QWEN)  # and QWEN_LARGE in the slow tier
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "languages": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        },
        "required": ["name", "age", "languages"],
        "additionalProperties": False,
    },
    "enum_and_bool": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "bright": {"type": "boolean"},
            "score": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["colour", "bright", "score"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
            "tags": {
                "type": "array",
                "items": {"enum": ["old", "big", "coastal"]},
                "minItems": 1,
                "maxItems": 2,
            },
        },
        "required": ["city", "location", "tags"],
        "additionalProperties": False,
    },
}
ASK = "Describe a person, a colour or a city as JSON."


def _format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _assert_validates(client, model: str, schema: str) -> None:
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": ASK}],
        response_format=_format(schema),
        max_tokens=160,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[schema])


@pytest.mark.parametrize("model", INSTRUCT)
@pytest.mark.parametrize("schema", list(SCHEMAS))
def test_chat_output_parses_and_validates_against_its_schema(shared_client, model, schema):
    _assert_validates(shared_client, model, schema)


def test_sampled_outputs_validate_too(shared_client):
    response = shared_client.chat.completions.create(
        model=SMOL,
        messages=[{"role": "user", "content": ASK}],
        response_format=_format("enum_and_bool"),
        max_tokens=120,
        temperature=1.0,
        n=4,
        seed=7,
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS["enum_and_bool"])


def test_json_object_on_completions_streamed(shared_client):
    stream = shared_client.completions.create(
        model=GEMMA,
        prompt="A JSON object describing a cat:",
        extra_body={"response_format": {"type": "json_object"}},
        max_tokens=64,
        temperature=0,
        stream=True,
    )
    text, reasons = "", []
    for chunk in stream:
        text += chunk.choices[0].text
        reasons.append(chunk.choices[0].finish_reason)
    if reasons[-1] == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # an object that did not close within max_tokens: a prefix of one, never anything else
        assert reasons[-1] == "length" and text.startswith("{")


def test_streamed_chat_with_a_schema_parses(shared_client):
    stream = shared_client.chat.completions.create(
        model=QWEN,
        messages=[{"role": "user", "content": ASK}],
        response_format=_format("person"),
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["person"])


def test_without_the_mask_these_models_do_not_write_valid_json(shared_client):
    """The control: the same request unconstrained validates against none of the schemas, so the
    mask is what makes the tests above pass."""
    for model in INSTRUCT:
        text = (
            shared_client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": ASK}], max_tokens=48, temperature=0
            )
            .choices[0]
            .message.content
        )
        for schema in SCHEMAS.values():
            with pytest.raises((ValueError, jsonschema.ValidationError)):
                jsonschema.validate(json.loads(text), schema)


def test_guided_choice_and_regex_give_exactly_what_they_allow(shared_client):
    choices = ["zebra-7", "quokka-9"]
    for model in (SMOL, QWEN):
        text = (
            shared_client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Say hello."}],
                extra_body={"guided_choice": choices},
                max_tokens=20,
                temperature=0,
            )
            .choices[0]
            .message.content
        )
        assert text in choices
    text = (
        shared_client.completions.create(
            model=SMOL,
            prompt="The date today is",
            extra_body={"guided_regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"},
            max_tokens=20,
            temperature=0,
        )
        .choices[0]
        .text
    )
    assert len(text) == 10 and text[4] == text[7] == "-" and text.replace("-", "").isdigit()


def test_llamacpp_json_schema_and_vllm_guided_json_take_a_schema(shared_client):
    for field in ("json_schema", "guided_json"):
        text = (
            shared_client.chat.completions.create(
                model=QWEN,
                messages=[{"role": "user", "content": ASK}],
                extra_body={field: SCHEMAS["enum_and_bool"]},
                max_tokens=80,
                temperature=0,
            )
            .choices[0]
            .message.content
        )
        jsonschema.validate(json.loads(text), SCHEMAS["enum_and_bool"])


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"guided_regex": "(?<=a)b"}, "guided_regex", "look-around"),
        (
            {
                "response_format": _format("person")
                | {"json_schema": {"name": "p", "schema": {"$ref": "http://x/y"}}}
            },
            "response_format",
            "http://x/y",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, None, "at most one"),
        ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ],
)
def test_a_grammar_that_cannot_be_enforced_is_a_400_naming_it(shared_client, body, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        shared_client.chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, extra_body=body
        )
    error = caught.value.body
    assert words in error["message"]
    if param is not None:
        assert error["param"].startswith(param)


@pytest.mark.slow
def test_the_largest_instruct_model_validates_too():
    """Qwen2.5-Coder 1.5B (the slow tier: POLYLANE_SLOW=1), every schema."""
    fetch_or_skip(QWEN_LARGE)
    server = start_server((QWEN_LARGE,), kv_tokens=1024, dtype="auto")
    try:
        client = server.openai(timeout=600)
        for schema in SCHEMAS:
            _assert_validates(client, QWEN_LARGE, schema)
    finally:
        server.stop()
