"""Tool calling: OpenAI's `tools` through the model's own chat template, and its calls back out.

What this module owns: which chat templates can call tools (those that write calls as Hermes-style
`<tool_call>{"name": …, "arguments": …}</tool_call>` blocks, as the Qwen2.5 templates do), the
grammar that makes a `required` or named `tool_choice` a call whatever the model would say, and
parsing the generated text into OpenAI's `tool_calls` (whole, or streamed: `ToolCallStream`
holds text back from the first `<tool_call>` on, so a call never leaks out as content). Small
Qwen2.5-Coder models often write the call's JSON without the tags (as llama.cpp also found): an
output that is nothing but such objects (one per line, or in a ```json fence) naming declared
tools is read as calls too, and a streamed output that begins like one is held until it ends.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import llguidance

from polylane.grammar_spec import GrammarError
from polylane.types import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 8  # calls in one output under a required or named tool_choice


def supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders `tools` and writes calls as `<tool_call>` blocks."""
    return bool(chat_template) and "tools" in chat_template and OPEN in chat_template  # type: ignore[operator]


def call_grammar(tools: list[dict[str, Any]], names: list[str], parallel: bool) -> GrammarSpec:
    """The grammar of output that is only tool calls (one, or several with `parallel`) to the
    functions `names`, each call's arguments matching its function's parameter schema. The call
    markers are the tokenizer's own `<tool_call>` tokens (llguidance resolves the names)."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": by_name[name].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name in names
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    # the separators the templates write (json.dumps's), no other whitespace
    schema = {
        **schema,
        "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    }
    repeat = f' ("\\n" call)~0..{MAX_PARALLEL_CALLS - 1}' if parallel else ""
    lark = f'start: call{repeat}\ncall: {OPEN} "\\n" body "\\n" {CLOSE}\nbody: %json {json.dumps(schema)}\n'
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except (TypeError, ValueError) as error:
        raise GrammarError(f"the tools' parameter schemas cannot be used: {error}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError("; ".join(m.strip().replace("\n", " ") for m in messages))
    return GrammarSpec("tool_calls", grammar)


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _bare_calls(text: str, names: set[str]) -> list[dict[str, Any]]:
    """Calls written without tags: the whole text (maybe in a ```json fence) is objects with a
    declared `name` and object `arguments`, one per line or one in all; else none."""
    body = text.strip()
    if body.startswith("```"):
        body = body.removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    pieces = [body] if body.startswith("{") else []
    try:
        objects = [json.loads(p) for p in pieces]
    except ValueError:
        try:
            objects = [json.loads(line) for line in body.splitlines() if line.strip()]
        except ValueError:
            return []
    if not objects or not all(
        isinstance(o, dict) and o.get("name") in names and isinstance(o.get("arguments", {}), dict)
        for o in objects
    ):
        return []
    return [_call(o["name"], o.get("arguments", {})) for o in objects]


def looks_like_bare_call(text: str) -> bool:
    """Whether streamed text so far may be a call written without tags (`_bare_calls`)."""
    start = text.lstrip()
    return start.startswith("{") or start.startswith("```")


def parse_calls(text: str, names: set[str] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of generated text: every complete `<tool_call>` block that holds a
    JSON object with a string `name` becomes a call; the text outside the blocks is the content
    (None when only whitespace). A block that does not parse stays in the content, as written.
    Without blocks, an output of nothing but calls to the tools `names` is read as calls."""
    calls: list[dict[str, Any]] = []
    content: list[str] = []
    rest = text
    while (start := rest.find(OPEN)) >= 0:
        end = rest.find(CLOSE, start)
        if end < 0:
            break
        body = rest[start + len(OPEN) : end].strip()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("name"), str):
            content.append(rest[:start])
            calls.append(_call(parsed["name"], parsed.get("arguments", {})))
        else:
            content.append(rest[: end + len(CLOSE)])
        rest = rest[end + len(CLOSE) :]
    if calls and OPEN in rest:  # a call cut short (max_tokens): not content
        rest = rest[: rest.find(OPEN)]
    content.append(rest)
    joined = "".join(content)
    if not calls and names and (bare := _bare_calls(text, names)):
        return None, bare
    return (joined if joined.strip() else None) if calls else joined, calls


@dataclass
class ToolCallStream:
    """A streamed choice's text with tools on: content goes out as it comes until a `<tool_call>`
    may begin (a tail that is a prefix of the marker waits for the next piece); from there it is
    held, and `finish` parses what was held into calls (and content, if no call parsed). An output
    that begins like a call without tags is held from its start."""

    names: set[str] = field(default_factory=set)
    held: str = ""
    calling: bool = False
    sent: bool = False  # some content went out already

    def push(self, text: str) -> str:
        """The part of `text` that is content for the client now."""
        if self.calling:
            self.held += text
            return ""
        text = self.held + text
        self.held = ""
        if not self.sent and self.names:
            if not text.strip():
                self.held = text
                return ""
            if looks_like_bare_call(text):
                self.calling, self.held = True, text
                return ""
        start = text.find(OPEN)
        if start >= 0:
            self.calling, self.held = True, text[start:]
            self.sent = self.sent or start > 0
            return text[:start]
        keep = next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-n:])), 0)
        out = text[:-keep] if keep else text
        self.held = text[len(out) :]
        self.sent = self.sent or bool(out)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to send, tool calls) at the end of the choice."""
        content, calls = parse_calls(self.held, None if self.sent else self.names)
        self.held = ""
        return content or "", calls
