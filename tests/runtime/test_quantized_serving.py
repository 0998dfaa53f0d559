"""Serving a model with weight-only int8 / int4 projections (`dtype="int8" | "int4"`).

- Logits stay within the documented tolerance of the float32 model on the same file, at every
  position of a text (teacher-forced): the quantised top-1 token is always among the float32 top 5,
  agrees with the float32 top 1 at least INT8_TOP1 / INT4_TOP1 of the time, and the mean absolute
  logit difference stays under INT8_MEAN_ABS / INT4_MEAN_ABS (logits are O(10)). Measured on
  SmolLM2 (the native stack where it runs, 2026-12-05): int8 96.7% top-1, mean 0.25; int4 87.8%,
  mean 0.41 (the GGUF's 4-bit weights are dequantised, then re-quantised in groups of 32 with bf16
  scales).
- Speculation stays lossless against the quantised target: the engine serving the int4 model with
  n-gram drafts returns the tokens plain int4 greedy decoding returns, and drafts were accepted.
"""

from __future__ import annotations

import pytest
import torch

from polylane.engine import Engine, EngineConfig
from polylane.runtime.batch import build_forward_batch
from polylane.runtime.generate import GenerationRequest, Generator
from polylane.runtime.kv_cache import PagedKVCache
from polylane.types import SamplingParams, SequenceChunk
from tests.conftest import fetch_or_skip

SMOL = "smollm2-135m-instruct"
INT8_TOP1, INT8_MEAN_ABS = 0.90, 0.35
INT4_TOP1, INT4_MEAN_ABS = 0.80, 0.60
TOLERANCE = {"int8": (INT8_TOP1, INT8_MEAN_ABS), "int4": (INT4_TOP1, INT4_MEAN_ABS)}
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a screw press. Within fifty years, presses "
    "operated in more than two hundred cities across Europe, and the price of books fell sharply.\n"
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
)


def _all_position_logits(model, ids: list[int]) -> torch.Tensor:
    blocks = -(-len(ids) // 16)
    cache = PagedKVCache(model.config, blocks, 16, model.dtype)
    batch = build_forward_batch([SequenceChunk(tuple(ids), 0, tuple(range(blocks)))], 16, model.config)
    batch.logit_rows = torch.arange(len(ids))
    return model.module(batch, cache)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantised_logits_within_documented_tolerance(load_real_model, dtype):
    fetch_or_skip(SMOL)
    reference = load_real_model(SMOL)
    quantised = load_real_model(SMOL, dtype)
    ids = reference.tokenizer.encode(TEXT)
    expected, got = _all_position_logits(reference, ids), _all_position_logits(quantised, ids)
    top1 = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    top5 = expected.topk(5, dim=-1).indices
    in_top5 = (top5 == got.argmax(-1, keepdim=True)).any(-1).float().mean().item()
    mean_abs = (got - expected).abs().mean().item()
    message = (
        f"{dtype} vs fp32 over {len(ids)} positions: top-1 agreement {top1:.3f}, top-1 in fp32 top-5 "
        f"{in_top5:.3f}, mean-abs {mean_abs:.3f}, max-abs {(got - expected).abs().max().item():.2f}"
    )
    print(message)
    min_top1, max_mean_abs = TOLERANCE[dtype]
    assert in_top5 == 1.0, message
    assert top1 >= min_top1, message
    assert mean_abs <= max_mean_abs, message
    assert quantised.weight_bytes < reference.weight_bytes / 2, "quantised weights should be far smaller"


def test_speculation_is_lossless_against_the_int4_target(load_real_model):
    fetch_or_skip(SMOL)
    model = load_real_model(SMOL, "int4")
    messages = [
        "Repeat this exactly: red, green, blue, red, green, blue, red, green.",
        "List the numbers from one to ten, separated by commas.",
    ]
    prompts = [model.tokenizer.render_chat([{"role": "user", "content": m}]) for m in messages]
    params = SamplingParams(max_tokens=16)
    generator = Generator(model, num_blocks=64, block_size=16)
    plain = [generator.generate([GenerationRequest(tuple(p), params)])[0].token_ids for p in prompts]

    speculation = {"drafters": ["ngram"], "adaptive": False, "max_draft_tokens": 4}
    with Engine(EngineConfig(budget_bytes=2 * 2**30)) as engine:
        engine.add_model(SMOL, dtype="int4", kv_tokens=1024, speculation=speculation)
        handles = [engine.submit(SMOL, p, params=params) for p in prompts]
        outputs = [h.result(timeout=300).token_ids for h in handles]
        pairs = engine.stats().speculation
    for i, (got, want) in enumerate(zip(outputs, plain, strict=True)):
        assert got == want, f"request {i}: speculative int4 output differs from plain int4 greedy"
    assert sum(p.accepted_tokens for p in pairs) > 0, "no draft token accepted (vacuous)"
