"""Serving a model with weight-only int8 / int4 projections (`dtype="int8" | "int4"`).

- Logits stay within the documented tolerance of the float32 model on the same file, at every
  position of a text (teacher-forced): the quantised top-1 token is always among the float32 top 5,
  agrees with the float32 top 1 at least INT8_TOP1 / INT4_TOP1 of the time, and the mean absolute
  logit difference stays under INT8_MEAN_ABS / INT4_MEAN_ABS (logits are O(10)). Measured on
  SmolLM2 (the native stack where it runs, 2026-12-05): int8 96.7% top-1, mean 0.25; int4 87.8%,
  mean 0.41 (the GGUF's 4-bit weights are dequantised, then re-quantised in groups of 32 with bf16
  scales).
- A long prompt (past DEQUANTIZE_MIN_ROWS, where the torch path multiplies by weights unpacked
  from torch's int4 packing) keeps the same agreement with float32, on the torch path and on the
  native stack where it runs: unpacking in the wrong layout (as on AVX2 CPUs before) fails it.
- Speculation stays lossless against the quantised target: the engine serving the int4 model with
  n-gram drafts returns the tokens plain int4 greedy decoding returns, and drafts were accepted.
"""

from __future__ import annotations

import pytest
import torch

from polylane.engine import Engine, EngineConfig
from polylane.runtime.generate import GenerationRequest, Generator
from polylane.runtime.kv.kv_cache import PagedKVCache
from polylane.runtime.model.batch import build_forward_batch
from polylane.runtime.model.compute_paths import why_not_native
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

# ~300 tokens of varied prose and code (one forward: a prompt chunk as the engine prefills it)
LONG_TEXT = TEXT + (
    "Scholars still argue about how quickly literacy spread after the press arrived. Some point to "
    "the flood of pamphlets during the Reformation; others note that most people learned to read "
    "from prayer books, almanacs and broadsides rather than from the great folio editions.\n"
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n"
    "The weather in the mountains changes quickly: a clear morning can turn into a snowstorm by noon, "
    "so experienced hikers carry a map, a compass, warm layers and enough water for the whole day."
)


def _all_position_logits(model, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits at every position of `ids`, prefilled in one forward or in chunks of `chunk` tokens."""
    blocks = -(-len(ids) // 16)
    cache = PagedKVCache(model.config, blocks, 16, model.dtype)
    chunk = chunk or len(ids)
    parts = []
    for start in range(0, len(ids), chunk):
        piece = SequenceChunk(tuple(ids[start : start + chunk]), start, tuple(range(blocks)), logits="all")
        batch = build_forward_batch([piece], 16, model.config)
        parts.append(model.module(batch, cache))
    return torch.cat(parts)


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


@pytest.mark.parametrize("path", ["torch", "native"])
def test_a_long_int4_prompt_agrees_with_float32(load_real_model, path):
    from polylane.runtime.model.quantize import DEQUANTIZE_MIN_ROWS

    fetch_or_skip(SMOL)
    reference = load_real_model(SMOL)
    quantised = load_real_model(SMOL, "int4")
    stack = quantised.module.native_stack
    if path == "native" and stack is None:
        pytest.skip(f"this model runs on torch here: {why_not_native()}")
    ids = reference.tokenizer.encode(LONG_TEXT)
    assert len(ids) >= max(200, DEQUANTIZE_MIN_ROWS + 1), f"the prompt has {len(ids)} tokens"
    # on the native stack, in prompt chunks it takes (a CPU without AMX hands 128+ tokens to torch)
    chunk = stack.max_tokens - 1 if path == "native" else None
    quantised.module.native_stack = stack if path == "native" else None
    try:
        got = _all_position_logits(quantised, ids, chunk)
    finally:
        quantised.module.native_stack = stack
    expected = _all_position_logits(reference, ids)
    top1 = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    mean_abs = (got - expected).abs().mean().item()
    message = f"int4 ({path} path) vs fp32, {len(ids)}-token prompt: top1 {top1:.3f}, mean-abs {mean_abs:.2f}"
    print(message)
    assert top1 >= INT4_TOP1 and mean_abs <= INT4_MEAN_ABS, message


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
    with Engine(EngineConfig(budget_bytes=2 * 2**30, threads=torch.get_num_threads())) as engine:
        engine.add_model(SMOL, dtype="int4", kv_tokens=1024, speculation=speculation)
        handles = [engine.submit(SMOL, p, params=params) for p in prompts]
        outputs = [h.result(timeout=300).token_ids for h in handles]
        pairs = engine.stats().speculation
    for i, (got, want) in enumerate(zip(outputs, plain, strict=True)):
        assert got == want, f"request {i}: speculative int4 output differs from plain int4 greedy"
    assert sum(p.accepted_tokens for p in pairs) > 0, "no draft token accepted (vacuous)"
