"""Paging is invisible: block size, block placement, prefill chunking and batch neighbours do not
change a sequence's greedy tokens, and its logits stay within float32 tolerance of running alone.
"""

from __future__ import annotations

import random

import pytest
import torch

from polylane.runtime.generate import GenerationOutput, GenerationRequest, Generator
from polylane.types import SamplingParams

NEW_TOKENS = 16
TOLERANCE = 1e-4

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "List the planets of the solar system in order from the sun:",
    "def quicksort(items):\n",
]


def _requests(model, prompts, start_steps=None) -> list[GenerationRequest]:
    start_steps = start_steps or [0] * len(prompts)
    return [
        GenerationRequest(
            tuple(model.tokenizer.encode(text)),
            SamplingParams(max_tokens=NEW_TOKENS),
            start_step=start,
            stop_at_eos=False,
        )
        for text, start in zip(prompts, start_steps, strict=True)
    ]


def _scramble_free_list(generator: Generator, seed: int) -> None:
    """Hand out blocks in a random order, so no sequence gets consecutive blocks."""
    pool = generator.kv.pool
    blocks = pool.allocate(pool.num_free)
    random.Random(seed).shuffle(blocks)
    pool.free(blocks)


def _compare(name: str, got: GenerationOutput, want: GenerationOutput) -> None:
    assert got.token_ids == want.token_ids, f"{name}: tokens {got.token_ids} != {want.token_ids}"
    max_abs = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True))
    assert max_abs < TOLERANCE, f"{name}: logits max-abs {max_abs:.2e} >= {TOLERANCE}"


_ALONE: dict[str, list[GenerationOutput]] = {}


def _model_and_reference(load_real_model, name: str):
    """The model and each prompt's output when it runs alone (block size 16, one sequence)."""
    model = load_real_model(name)
    if name not in _ALONE:
        _ALONE[name] = [
            Generator(model, num_blocks=8, block_size=16).generate([r], record_logits=True)[0]
            for r in _requests(model, PROMPTS)
        ]
    return model, _ALONE[name]


# Gemma 3 (262k-vocabulary head per step) is paged with block size 4 and 3 in the tests below.
@pytest.mark.parametrize("block_size", [1, 5, 64])
def test_block_size_does_not_matter(load_real_model, block_size):
    model, alone = _model_and_reference(load_real_model, "smollm2-135m-instruct")
    for index, request in enumerate(_requests(model, PROMPTS)):
        generator = Generator(model, num_blocks=-(-128 // block_size), block_size=block_size)
        _scramble_free_list(generator, seed=block_size)
        [output] = generator.generate([request], record_logits=True)
        _compare(f"{model.name} prompt {index} block_size {block_size}", output, alone[index])


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_interleaved_batch_matches_running_alone(load_real_model, name):
    """Three sequences join at different steps, prefill in 7-token chunks next to decodes."""
    model, alone = _model_and_reference(load_real_model, name)
    generator = Generator(model, num_blocks=64, block_size=4, prefill_chunk=7)
    _scramble_free_list(generator, seed=7)
    outputs = generator.generate(_requests(model, PROMPTS, start_steps=[0, 3, 9]), record_logits=True)
    for index, output in enumerate(outputs):
        _compare(f"{model.name} prompt {index} interleaved", output, alone[index])
    assert generator.kv.pool.num_free == generator.kv.pool.num_blocks, "blocks leaked"


def test_sliding_window_under_paging(load_real_model):
    """Gemma 3: a context past the 512-token window, chunked and paged, matches one-shot prefill."""
    model = load_real_model("gemma3-270m")
    window = model.config.sliding_window
    text = " ".join(f"Line {i} says the number {i * 13 % 97}." for i in range(90))
    prompt = tuple(model.tokenizer.encode(text))[: window + 40]
    assert len(prompt) > window, f"prompt has only {len(prompt)} tokens"
    request = GenerationRequest(prompt, SamplingParams(max_tokens=8), stop_at_eos=False)
    [want] = Generator(model, num_blocks=40, block_size=16, prefill_chunk=1024).generate(
        [request], record_logits=True
    )
    paged = Generator(model, num_blocks=200, block_size=3, prefill_chunk=100)
    _scramble_free_list(paged, seed=3)
    neighbour = GenerationRequest(
        tuple(model.tokenizer.encode(PROMPTS[0])), SamplingParams(max_tokens=8), stop_at_eos=False
    )
    got, _ = paged.generate([request, neighbour], record_logits=True)
    _compare("gemma3 sliding window, paged", got, want)
    assert torch.isfinite(torch.stack(got.logits)).all()
