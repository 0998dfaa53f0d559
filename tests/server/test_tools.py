"""Tool calling with the official `openai` client on Qwen2.5-Coder (its template's `<tool_call>`
blocks): `tools` rendered by the model's own template, calls parsed into `tool_calls` (streamed as
deltas too), `tool_choice` none / auto / required / a named function (the last two enforced by the
grammar), parallel calls, and `role: "tool"` answers in the conversation."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from polylane.server.tools import ToolCallStream, parse_calls
from tests.server.conftest import QWEN, SMOL

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_lets_the_model_call_a_tool(shared_client):
    response = shared_client.chat.completions.create(
        model=QWEN, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=80, temperature=0
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    _check_calls(choice.message.tool_calls)
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert "<tool_call>" not in (choice.message.content or "")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_calls_and_matches_the_schema(shared_client, parallel):
    response = shared_client.chat.completions.create(
        model=QWEN,
        messages=[{"role": "user", "content": "Tell me a joke about cats."}],  # nothing to call for
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=64,
        temperature=0,
    )
    choice = response.choices[0]
    _check_calls(choice.message.tool_calls)
    if not parallel:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    else:  # a small model may call on and on: every complete call is valid, none cut short is shown
        assert choice.finish_reason in ("tool_calls", "length") and 1 <= len(choice.message.tool_calls) <= 8
        assert "<tool_call>" not in (choice.message.content or "")


def test_a_named_choice_calls_that_function(shared_client):
    response = shared_client.chat.completions.create(
        model=QWEN,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=80,
        temperature=0,
    )
    calls = response.choices[0].message.tool_calls
    _check_calls(calls)
    assert {c.function.name for c in calls} == {"get_time"}


def test_none_hides_the_tools(shared_client):
    response = shared_client.chat.completions.create(
        model=QWEN, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")


def test_streamed_calls_arrive_as_deltas(shared_client):
    stream = shared_client.chat.completions.create(
        model=QWEN,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
        stream=True,
    )
    calls, content, reasons = {}, "", []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and "<tool_call>" not in content
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


def test_a_tool_answer_continues_the_conversation(shared_client):
    first = shared_client.chat.completions.create(
        model=QWEN, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    answer = shared_client.chat.completions.create(
        model=QWEN, messages=messages, tools=TOOLS, max_tokens=40, temperature=0
    )
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"model": SMOL, "tools": TOOLS}, "does not call tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not among the tools",
        ),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "same name"),
        (
            {"tools": TOOLS, "response_format": {"type": "json_object"}, "tool_choice": "required"},
            "cannot both",
        ),
    ],
)
def test_tool_requests_that_cannot_be_served_are_400s(shared_client, fields, words):
    body = {"model": QWEN, "messages": ASK, "max_tokens": 8, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        shared_client.chat.completions.create(**body)
    assert words in caught.value.body["message"]


def test_parsing_and_streaming_hold_back_only_calls():
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_calls(text)
    assert content == "Let me check." and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert parse_calls("<tool_call>not json</tool_call> ok") == ("<tool_call>not json</tool_call> ok", [])
    stream = ToolCallStream()
    out = "".join(
        stream.push(piece)
        for piece in ["Let me", " check.<tool", "_call>\n{", '"name": "x"}', "\n</tool_call>"]
    )
    assert out == "Let me check."
    rest, calls = stream.finish()
    assert rest == "" and calls[0]["function"]["name"] == "x"
    stream = ToolCallStream()
    assert stream.push("a <tool") == "a " and stream.push(" box") == "<tool box"
