"""Speculation in the engine on a real model: several requests of the lane's model speculating in
the same steps (n-gram and the int4 twin, counted in the residency budget) give the tokens plain
greedy gives; a request can opt out; the lane monitor sees the drafter inside its target's slot
and never two models decoding; statistics and /metrics report each pair; no block is left held."""

from __future__ import annotations

import torch

from polylane.engine import Engine, EngineConfig
from polylane.runtime.generate import GenerationRequest, Generator
from polylane.server.admission import Admission
from polylane.server.metrics import ServerMetrics
from polylane.types import SamplingParams
from tests.conftest import fetch_or_skip

SMOL = "smollm2-135m-instruct"
DTYPE = "auto"  # the default: the file's blocks, 8-bit activations (the reference runs the same)
MAX_TOKENS = 16
MESSAGES = [
    "Repeat this exactly: red, green, blue, red, green, blue, red, green.",
    "List the numbers from one to ten, separated by commas.",
]


def _held_blocks(kv) -> int:
    cached = kv.tree.num_cached_blocks if kv.tree is not None else 0
    return kv.pool.num_blocks - kv.pool.num_free - cached


def test_engine_speculation_is_lossless_and_reported(load_real_model):
    fetch_or_skip(SMOL)
    model = load_real_model(SMOL, DTYPE)
    prompts = [model.tokenizer.render_chat([{"role": "user", "content": m}]) for m in MESSAGES]
    generator = Generator(model, num_blocks=64, block_size=16)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    reference = [generator.generate([GenerationRequest(tuple(p), params)])[0].token_ids for p in prompts]

    speculation = {"drafters": ["ngram", "twin"], "adaptive": False, "max_draft_tokens": 4}
    # compared exactly with plain greedy: a fixed thread count (sums split over threads differ in order)
    with Engine(EngineConfig(budget_bytes=2 * 2**30, threads=torch.get_num_threads())) as engine:
        engine.add_model(SMOL, dtype=DTYPE, kv_tokens=1024, speculation=speculation)
        handles = [engine.submit(SMOL, p, params=params) for p in prompts]
        opted_out = engine.submit(SMOL, prompts[0], params=SamplingParams(max_tokens=8, speculation=False))
        sampled = engine.submit(SMOL, prompts[1], params=SamplingParams(max_tokens=8, temperature=0.8))
        outputs = [h.result(timeout=600).token_ids for h in handles]
        assert opted_out.result(timeout=600).token_ids == reference[0][:8]
        sampled_result = sampled.result(timeout=600)  # rejection sampling in the engine
        assert sampled_result.finish_reason in ("stop", "length") and sampled_result.error is None
        for i, (got, want) in enumerate(zip(outputs, reference, strict=True)):
            assert got == want, f"request {i}: speculative engine output differs from plain greedy"

        stats = engine.stats()
        pairs = {p.drafter: p for p in stats.speculation}
        print(
            {
                name: (p.rounds, p.accepted_tokens, p.draft_tokens, round(p.tokens_per_verify, 2))
                for name, p in pairs.items()
            }
        )
        assert set(pairs) == {"ngram", "twin:int4"}
        assert sum(p.rounds for p in pairs.values()) > 0
        assert sum(p.accepted_tokens for p in pairs.values()) > 0, "no draft token accepted (vacuous)"
        assert stats.max_concurrent_decode == 1
        twin = next(i for i in engine.manager.snapshot() if i.name == f"{SMOL}:int4")
        assert twin.state == "resident" and twin.bytes > 0  # the twin counts in the budget
        used = sum(i.bytes for i in engine.manager.snapshot() if i.state != "cold")
        assert used <= engine.manager.budget_bytes

        text = ServerMetrics(engine, Admission(16, 1 << 20)).render().decode()
        for name in (
            "polylane_spec_acceptance_rate",
            "polylane_spec_tokens_per_verify",
            "polylane_spec_draft_cost_share",
        ):
            assert f'{name}{{drafter="twin:int4",target="{SMOL}"}}' in text, name
        assert 'polylane_spec_decisions_total{decision="on",drafter="ngram"' in text

        for name in (SMOL, f"{SMOL}:int4"):
            handle = engine.manager._pool.handle(name)
            assert handle is not None and _held_blocks(handle.kv) == 0, f"{name}: blocks still held"
            assert handle.kv.tree.num_locks == 0
        # the twin's forwards ran inside the target's slot, counted apart (n-gram runs no model)
        assert stats.max_concurrent_drafters == (1 if pairs["twin:int4"].rounds else 0)


def test_speculation_in_a_kv_pool_too_small_for_its_drafts_stays_lossless(load_real_model):
    """Three requests whose prompts and outputs fill a 12-block pool: a decode step's lookahead for
    the drafts often finds no room, so the scheduler drops it (or preempts, recompute) rather than
    let a verify pass write outside the slots it reserved; every output is still plain greedy's."""
    fetch_or_skip(SMOL)
    model = load_real_model(SMOL, DTYPE)
    messages = [*MESSAGES, "Count down from ten to one, separated by commas."]
    prompts = [model.tokenizer.render_chat([{"role": "user", "content": m}]) for m in messages]
    generator = Generator(model, num_blocks=64, block_size=16)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    reference = [generator.generate([GenerationRequest(tuple(p), params)])[0].token_ids for p in prompts]
    blocks = sum(-(-(len(p) + MAX_TOKENS) // 16) for p in prompts)

    speculation = {"drafters": ["ngram"], "adaptive": False, "max_draft_tokens": 8}
    with Engine(EngineConfig(budget_bytes=2 * 2**30, threads=torch.get_num_threads())) as engine:
        engine.add_model(SMOL, dtype=DTYPE, kv_tokens=16 * blocks, speculation=speculation)
        handles = [engine.submit(SMOL, p, params=params) for p in prompts]
        results = [h.result(timeout=600) for h in handles]
        for i, (result, want) in enumerate(zip(results, reference, strict=True)):
            assert result.error is None, result.error
            assert result.token_ids == want, f"request {i}: differs from plain greedy"
        assert engine.stats().speculation[0].rounds > 0, "nothing speculated (vacuous)"
        kv = engine.manager._pool.handle(SMOL).kv
        assert _held_blocks(kv) == 0 and kv.tree.num_locks == 0
