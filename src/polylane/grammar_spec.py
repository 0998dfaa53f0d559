"""Structured outputs: what a request asks its output to match, as a grammar.

What this module owns: turning a JSON schema, "any JSON object", a regular expression or a choice
of strings into a `GrammarSpec` (llguidance's serialised grammar), and refusing what the grammar
engine cannot enforce with a message that names it (`GrammarError`, a 400 at the server). No
tokenizer is needed here: the grammar is compiled per model when the request is queued
(`runtime/sampling/grammar.py`).

The engine is llguidance (`bench/grammar_mask.py` measures it against xgrammar on the CPU). JSON
is generated without free whitespace (`whitespace_flexible` off): a small model let loose on
whitespace can fill its budget with it, and the output parses the same.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from polylane.types import GrammarSpec

__all__ = ["GrammarError", "grammar_for"]


class GrammarError(ValueError):
    """The grammar engine cannot enforce what the request asks for (the message says what)."""


def grammar_for(kind: str, value: Any = None) -> GrammarSpec:
    """The grammar of a `kind` of constraint: "json_object" (any JSON object), "json_schema" (the
    schema `value`, a dict), "regex" (a pattern string), "choice" (one of a list of strings).
    Raises GrammarError naming what llguidance refuses (look-around in a pattern, a remote $ref)."""
    if kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps({"type": "object"}), defaults={"whitespace_flexible": False}
        )
    elif kind == "json_schema":
        if not isinstance(value, dict):
            raise GrammarError("the JSON schema must be an object")
        grammar = _json_schema(value)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        if not value or not all(isinstance(v, str) and v for v in value):
            raise GrammarError("the choices must be a non-empty list of non-empty strings")
        grammar = llguidance.LLMatcher.grammar_from_regex("|".join(_regex_literal(v) for v in value))
    else:
        raise GrammarError(f"unknown kind of constraint {kind!r}")
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(
            "; ".join(m.strip().replace("\n", " ") for m in messages) or "the grammar is invalid"
        )
    return GrammarSpec(kind, grammar)


def _json_schema(schema: dict[str, Any]) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
    except (TypeError, ValueError) as error:
        raise GrammarError(f"the JSON schema cannot be used: {error}") from None


def _regex_literal(text: str) -> str:
    return "".join(f"\\{c}" if c in r"\.^$|?*+()[]{}/" else c for c in text)
