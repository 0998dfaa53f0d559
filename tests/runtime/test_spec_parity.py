"""Greedy speculation on real models is token-identical to plain greedy decoding (fp32 targets).

Drafters: n-gram prompt lookup and the quantised twin on SmolLM2-135M, Qwen2.5-Coder-0.5B for
the 1.5B; chain and tree shapes, two requests speculating in the same steps. An adversarial
drafter (every token shifted, so almost always wrong) must still give identical output and force
rollbacks in target and drafter. After every run no KV block is held, in the target's pool or the
drafter's. Non-vacuity: each case asserts that drafts were proposed, and (except the adversary)
accepted.
"""

from __future__ import annotations

import gc

import pytest

from polylane.policy.speculation.control import SpeculationConfig
from polylane.policy.speculation.tree import TreeShape
from polylane.runtime.generate import GenerationRequest, Generator
from polylane.runtime.kv.model_kv import ModelKV
from polylane.runtime.loading.loaded_model import LoadedModel, load_model
from polylane.runtime.speculation.drafters import ModelDrafter, NgramDrafter
from polylane.runtime.speculation.generate import SpeculativeGenerator
from polylane.runtime.speculation.speculator import Speculator
from polylane.types import SamplingParams
from tests.conftest import fetch_or_skip

SMOL = "smollm2-135m-instruct"
QWEN_SMALL, QWEN_LARGE = "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"
MAX_TOKENS = 20
SHAPES = {"chain": TreeShape.chain(4), "tree": TreeShape.topk(2, 2, 1, 1)}
SMOL_MESSAGES = [
    "Copy this list exactly: apples, pears, plums, cherries, apples, pears, plums.",
    "Write a Python function that returns the square of a number.",
]
CODE_PROMPTS = [
    'def is_prime(n: int) -> bool:\n    """Return True when n is prime."""\n',
    "# Parse a CSV line into fields\ndef parse_line(line):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import json\n\ndef load(path):\n    with open(path) as f:\n",
]


def _prompts(model: LoadedModel) -> list[tuple[int, ...]]:
    return [tuple(model.tokenizer.render_chat([{"role": "user", "content": m}])) for m in SMOL_MESSAGES]


def _plain(model: LoadedModel, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Each prompt alone through the plain generator: the reference."""
    generator = Generator(model, num_blocks=64, block_size=16)
    params = SamplingParams(max_tokens=max_tokens)
    return [generator.generate([GenerationRequest(p, params)])[0].token_ids for p in prompts]


def _speculate(model, speculator, prompts, max_tokens: int = MAX_TOKENS):
    generator = SpeculativeGenerator(model, speculator, num_blocks=96, block_size=16)
    params = SamplingParams(max_tokens=max_tokens)
    outputs = generator.generate([GenerationRequest(p, params) for p in prompts])
    kv = generator.kv
    assert kv.pool.num_free == kv.pool.num_blocks, "target blocks leaked"
    return outputs


def _speculator(target: LoadedModel, shape: TreeShape) -> Speculator:
    return Speculator(target.name, SpeculationConfig(shape=shape, adaptive=False))


def _check(label, outputs, reference, *, expect_accepted: bool = True, speculator=None) -> None:
    got = [o.token_ids for o in outputs]
    drafted = sum(o.drafted for o in outputs)
    accepted = sum(o.accepted for o in outputs)
    rounds = sum(o.rounds for o in outputs)
    print(f"{label}: {rounds} rounds, {accepted}/{drafted} draft tokens accepted")
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        assert a == b, f"{label}: prompt {i} differs from plain greedy at token {first}: {a} vs {b}"
    assert rounds > 0 and drafted > 0, f"{label}: nothing was drafted"
    if expect_accepted:
        assert accepted > 0, f"{label}: no draft token was ever accepted (vacuous)"
    if speculator is not None and "tree" in label:
        tree_rounds = sum(p.tree_rounds for p in speculator.stats.values())
        assert tree_rounds > 0, f"{label}: no round verified a tree"


@pytest.fixture(scope="module")
def smol(load_real_model) -> LoadedModel:
    return load_real_model(SMOL)


@pytest.fixture(scope="module")
def smol_reference(smol) -> list[list[int]]:
    return _plain(smol, _prompts(smol))


@pytest.fixture(scope="module")
def smol_twin(load_real_model) -> LoadedModel:
    # the session's int4 twin (the native-stack tests load the same one): quantising is the slow part
    return load_real_model(SMOL, "int4")


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_ngram_greedy_parity(smol, smol_reference, shape):
    speculator = _speculator(smol, SHAPES[shape])
    speculator.add_drafter(NgramDrafter(), 0.0)
    outputs = _speculate(smol, speculator, _prompts(smol))
    _check(f"n-gram {shape}", outputs, smol_reference, speculator=speculator)


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_quantised_twin_greedy_parity(smol, smol_twin, smol_reference, shape):
    speculator = _speculator(smol, SHAPES[shape])
    draft_kv = ModelKV(smol_twin, num_blocks=96, block_size=16, prefix_cache=False)
    speculator.add_drafter(ModelDrafter("twin:int4", "twin", draft_kv, smol.name, speculator.monitor), 0.3)
    outputs = _speculate(smol, speculator, _prompts(smol))
    _check(f"int4 twin {shape}", outputs, smol_reference, speculator=speculator)
    assert speculator.monitor.max_concurrent == 1 and speculator.monitor.max_concurrent_drafters == 1
    assert draft_kv.pool.num_free == draft_kv.pool.num_blocks, "drafter blocks leaked"


class AdversarialDrafter(ModelDrafter):
    """Drafts the drafter's candidates shifted by one token id: (almost) always wrong."""

    def _expand(self, job, builder, node, logits):
        original = builder.expand

        def shifted(at, candidates):
            original(at, [((token + 1) % logits.shape[0], prob) for token, prob in candidates])

        builder.expand = shifted
        try:
            super()._expand(job, builder, node, logits)
        finally:
            builder.expand = original


def test_adversarial_drafter_rolls_back_and_changes_nothing(smol, smol_twin, smol_reference):
    shape = "tree"  # forks and compaction in the drafter, tree rollback in the target
    speculator = _speculator(smol, SHAPES[shape])
    draft_kv = ModelKV(smol_twin, num_blocks=96, block_size=16, prefix_cache=False)
    adversary = AdversarialDrafter("adversary", "twin", draft_kv, smol.name, speculator.monitor)
    speculator.add_drafter(adversary, 0.3)
    outputs = _speculate(smol, speculator, _prompts(smol), max_tokens=10)
    reference = [r[:10] for r in smol_reference]
    _check(f"adversary {shape}", outputs, reference, expect_accepted=False, speculator=speculator)
    drafted, accepted = sum(o.drafted for o in outputs), sum(o.accepted for o in outputs)
    assert accepted <= drafted // 4, f"the adversary was accepted too often ({accepted}/{drafted})"
    assert draft_kv.pool.num_free == draft_kv.pool.num_blocks, "drafter blocks leaked"


@pytest.fixture(scope="module")
def qwen_pair():
    fetch_or_skip(QWEN_SMALL)
    fetch_or_skip(QWEN_LARGE)
    # the drafter reads its GGUF blocks in place (dtype auto, about 1 s): its numbers only decide
    # what is proposed; the fp32 target's verify decides the output
    small = load_model(QWEN_SMALL, "auto", quiet=True)
    large = load_model(QWEN_LARGE, "fp32", quiet=True)
    assert small.tokenizer.digest == large.tokenizer.digest, "the Qwen pair must share a tokenizer"
    yield small, large
    del small, large
    gc.collect()


def _qwen_case(qwen_pair, prompts, shapes, max_tokens):
    small, large = qwen_pair
    encoded = [tuple(large.tokenizer.encode(p)) for p in prompts]
    reference = _plain(large, encoded, max_tokens)
    for label, shape in shapes.items():
        speculator = _speculator(large, shape)
        draft_kv = ModelKV(small, num_blocks=64, block_size=16, prefix_cache=False)
        speculator.add_drafter(
            ModelDrafter(QWEN_SMALL, "model", draft_kv, large.name, speculator.monitor), 0.3
        )
        outputs = _speculate(large, speculator, encoded, max_tokens)
        _check(f"qwen 0.5B→1.5B {label}", outputs, reference, speculator=speculator)
        assert draft_kv.pool.num_free == draft_kv.pool.num_blocks, "drafter blocks leaked"


def test_qwen_small_drafts_for_large(qwen_pair):
    _qwen_case(qwen_pair, CODE_PROMPTS[:1], SHAPES, max_tokens=12)


@pytest.mark.slow
def test_qwen_pair_over_many_prompts(qwen_pair):
    shapes = {**SHAPES, "dynamic": TreeShape.dynamic(6, 3, 12), "beam": TreeShape.beam(2, 4)}
    _qwen_case(qwen_pair, CODE_PROMPTS, shapes, max_tokens=48)
