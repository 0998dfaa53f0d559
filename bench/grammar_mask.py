"""Per-token cost of a grammar engine's token mask on the CPU: llguidance against xgrammar.

Structured outputs mask every decode step's logits with the tokens a grammar allows, so the mask's
cost is paid once per token on the lane (it cannot hide behind a GPU here). For each engine this
compiles a JSON schema for a model's tokenizer, then walks a valid document token by token,
timing the mask of every step (and checking that each next token is allowed), and prints the time
to index the vocabulary (once per model), to compile the schema (once per request) and the
per-token median and 95th percentile in microseconds.

    python bench/grammar_mask.py --model qwen2.5-coder-1.5b-instruct --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "tags": ["mathematics", "engines", "poetry of science"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "active": True,
}


def walk_llguidance(lltok: Any, eos: int, tokens: list[int]) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.torch

    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - started
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
    costs = []
    for token in [*tokens, eos]:
        begun = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
        costs.append(time.perf_counter() - begun)
        if not (int(mask[0, token // 32]) >> (token % 32)) & 1:
            raise SystemExit(f"llguidance forbids token {token} of a valid document")
        matcher.consume_token(token)
    return compile_s, costs


def walk_xgrammar(info: Any, eos: int, tokens: list[int]) -> tuple[float, list[float]]:
    import xgrammar

    started = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    matcher = xgrammar.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - started
    mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    costs = []
    for token in [*tokens, eos]:
        begun = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        costs.append(time.perf_counter() - begun)
        if not (int(mask[0, token // 32]) >> (token % 32)) & 1:
            raise SystemExit(f"xgrammar forbids token {token} of a valid document")
        matcher.accept_token(token)
    return compile_s, costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from polylane import catalog
    from polylane.runtime.sampling.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(catalog.resolve(args.model, quiet=True))
    backend = tokenizer.backend
    eos = backend.eos_token_id
    vocab_size = len(backend)
    tokens = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    print(f"{args.model}: vocabulary {vocab_size}, document {len(tokens)} tokens, {args.repeats} repeats")
    import llguidance.hf
    import xgrammar

    started = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(backend, n_vocab=vocab_size, eos_token=eos)
    vocabularies = {"llguidance": time.perf_counter() - started}
    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(backend, vocab_size=vocab_size, stop_token_ids=[eos])
    vocabularies["xgrammar"] = time.perf_counter() - started
    print(
        "| engine | vocabulary index, once per model (ms) | schema compile, per request (ms, median) "
        "| mask per token, median (µs) | p95 (µs) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name in ("llguidance", "xgrammar"):
        compiles, costs = [], []
        for _ in range(args.repeats):
            if name == "llguidance":
                compile_s, walk = walk_llguidance(lltok, eos, tokens)
            else:
                compile_s, walk = walk_xgrammar(info, eos, tokens)
            compiles.append(compile_s)
            costs.extend(walk)
        costs.sort()
        p95 = costs[int(0.95 * (len(costs) - 1))]
        print(
            f"| {name} | {vocabularies[name] * 1e3:.0f} | {statistics.median(compiles) * 1e3:.1f} "
            f"| {statistics.median(costs) * 1e6:.1f} | {p95 * 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
