"""KV that is reused is exact, on real models: rollback is bit-exact and never rewrites the kept KV;
a prompt served from the prefix tree (whole blocks, a match ending inside a block, a fork that
writes into a shared block) continues like a cold prefill.
"""

from __future__ import annotations

import pytest
import torch

from polylane.runtime.generate import GenerationRequest, Generator
from polylane.runtime.kv.model_kv import Extend, ModelKV
from polylane.types import SamplingParams

TOLERANCE = 1e-4  # float32 logits, max-abs, cached prefix vs cold prefill
TEXT = (
    "Ada Lovelace wrote the first program for Charles Babbage's Analytical Engine in 1843. "
    "She saw that the machine could manipulate symbols, not only numbers, and might one day "
    "compose music. Her notes were three times longer than the article they annotated. "
    "A century later, Alan Turing read them and answered her objection in a famous paper."
)


def _decode(kv: ModelKV, sequence, tokens: list[int]) -> list[torch.Tensor]:
    """Feed `tokens` one decode step each; the logits after each."""
    return [kv.forward([Extend(sequence, (token,))])[0].clone() for token in tokens]


def _greedy(kv: ModelKV, sequence, first_logits: torch.Tensor, steps: int) -> list[int]:
    tokens, logits = [], first_logits
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = kv.forward([Extend(sequence, (tokens[-1],))])[0]
    return tokens


def _kept_bytes(kv: ModelKV, sequence, num_tokens: int) -> list[torch.Tensor]:
    slots = torch.tensor([sequence.blocks.slot(i) for i in range(num_tokens)])
    return [layer.index_select(0, slots) for layer in (*kv.cache.keys, *kv.cache.values)]


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_rollback_is_bit_exact(load_real_model, name):
    model = load_real_model(name)
    prompt = tuple(model.tokenizer.encode(TEXT))[:37]
    kv = ModelKV(model, num_blocks=32, block_size=8, prefix_cache=False)
    sequence = kv.open(prompt)
    first = kv.forward([Extend(sequence, prompt)])[0]
    decoded = _greedy(kv, sequence, first, steps=7)  # 6 of them now have KV
    keep = len(prompt) + 2
    before = _kept_bytes(kv, sequence, keep)
    kv.rollback(sequence, keep)
    assert len(sequence.blocks.table) == kv.pool.blocks_for(keep), "tail blocks were not freed"
    other = [int(t) for t in model.tokenizer.encode(" and then the sky turned green")][:5]
    assert other != decoded[2:7], "the new continuation must differ from the rolled-back one"
    got = _decode(kv, sequence, other)
    after = _kept_bytes(kv, sequence, keep)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "kept KV was rewritten"

    fresh_kv = ModelKV(model, num_blocks=32, block_size=8, prefix_cache=False)
    fresh = fresh_kv.open(prompt)
    fresh_kv.forward([Extend(fresh, prompt)])
    _decode(fresh_kv, fresh, decoded[:2])
    want = _decode(fresh_kv, fresh, other)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        diff = (a - b).abs().max().item()
        assert torch.equal(a, b), f"{name}: step {step} after rollback differs by {diff:.2e}"
    kv.close(sequence)
    fresh_kv.close(fresh)
    assert kv.pool.num_free == kv.pool.num_blocks, "blocks leaked"


def _generate(generator: Generator, prompt: tuple[int, ...], tokens: int = 6):
    request = GenerationRequest(prompt, SamplingParams(max_tokens=tokens), stop_at_eos=False)
    [output] = generator.generate([request], record_logits=True)
    return output


def _assert_same(label: str, got, want) -> float:
    assert got.token_ids == want.token_ids, f"{label}: tokens {got.token_ids} != cold {want.token_ids}"
    max_abs = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True))
    assert max_abs < TOLERANCE, f"{label}: logits max-abs {max_abs:.2e} vs cold prefill"
    return max_abs


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_prefix_reuse_matches_cold_prefill(load_real_model, name, record_property):
    model = load_real_model(name)
    ids = tuple(model.tokenizer.encode(TEXT))
    assert len(ids) >= 60, f"only {len(ids)} tokens"
    block = 8
    kv = ModelKV(model, num_blocks=64, block_size=block, prefix_cache=True)
    warm = Generator(model, kv=kv)
    cold = Generator(model, num_blocks=64, block_size=block)

    first = _generate(warm, ids[:48])  # caches 48 + 5 tokens: 6 whole blocks
    assert first.cached_tokens == 0

    cases = {
        # shares 43 tokens with the cache: 5 whole blocks and 3 tokens of the 6th (copy-on-write)
        "diverges inside a block": ids[:43] + tuple(model.tokenizer.encode(" Meanwhile, in Paris,")),
        # the cached prompt again: all of it but its last token comes from the cache
        "same prompt": ids[:48],
        # a longer prompt: whole cached blocks, then its own tail
        "extends the prompt": ids[:60],
    }
    expected_cached = {"diverges inside a block": 43, "same prompt": 47, "extends the prompt": 48}
    for label, prompt in cases.items():
        got = _generate(warm, prompt)
        assert got.cached_tokens == expected_cached[label], (
            f"{label}: {got.cached_tokens} tokens from the cache, expected {expected_cached[label]}"
        )
        max_abs = _assert_same(f"{name} {label}", got, _generate(cold, prompt))
        record_property(f"max_abs {label}", max_abs)
        print(f"{name} {label}: {got.cached_tokens} cached tokens, logits max-abs {max_abs:.2e}")
    # the copy-on-write above never changed the cached blocks: the first prompt still matches cold
    _assert_same(f"{name} cached prompt after copy-on-write", _generate(warm, ids[:48]), first)
    stats = kv.stats()
    assert stats is not None and 0 < stats.hit_rate < 1, f"{stats}"
    assert kv.pool.num_free + stats.cached_blocks == kv.pool.num_blocks, "blocks leaked"


def test_fork_writes_copy_the_shared_block(load_real_model):
    """Two forks of one sequence decode different tokens into their shared partial block; each
    matches a sequence that decoded its tokens alone."""
    model = load_real_model("smollm2-135m-instruct")
    prompt = tuple(model.tokenizer.encode(TEXT))[:21]  # ends inside the third 8-token block
    kv = ModelKV(model, num_blocks=32, block_size=8, prefix_cache=False)
    parent = kv.open(prompt)
    kv.forward([Extend(parent, prompt)])
    child = kv.fork(parent)
    shared = parent.blocks.table[-1]
    assert kv.pool.ref_count(shared) == 2
    continuations = {"parent": [11, 12, 13], "child": [21, 22, 23]}
    got = {
        "parent": _decode(kv, parent, continuations["parent"]),
        "child": _decode(kv, child, continuations["child"]),
    }
    assert parent.blocks.table[-1] != child.blocks.table[-1], "the shared block was not copied on write"
    for label, tokens in continuations.items():
        alone_kv = ModelKV(model, num_blocks=32, block_size=8, prefix_cache=False)
        alone = alone_kv.open(prompt)
        alone_kv.forward([Extend(alone, prompt)])
        want = _decode(alone_kv, alone, tokens)
        for step, (a, b) in enumerate(zip(got[label], want, strict=True)):
            max_abs = (a - b).abs().max().item()
            assert max_abs < TOLERANCE, f"{label} step {step}: max-abs {max_abs:.2e}"
    kv.close(parent)
    kv.close(child)
    assert kv.pool.num_free == kv.pool.num_blocks, "blocks leaked"


def test_aborted_sequence_never_enters_the_tree(load_real_model):
    model = load_real_model("smollm2-135m-instruct")
    prompt = tuple(model.tokenizer.encode(TEXT))[:40]
    kv = ModelKV(model, num_blocks=32, block_size=8, prefix_cache=True)
    sequence = kv.open(prompt)
    kv.forward([Extend(sequence, prompt)])
    kv.close(sequence, cache=False)
    assert kv.stats().cached_blocks == 0 and kv.pool.num_free == kv.pool.num_blocks
    again = kv.open(prompt)
    assert again.cached_tokens == 0, "an aborted sequence's KV was served from the cache"
    kv.close(again, cache=False)
