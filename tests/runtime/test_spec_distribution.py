"""Sampled speculation keeps the target's distribution: a statistical test on tiny synthetic models.

A target and a drafter with random weights and a vocabulary of 6 tokens (different models, so
the drafter is often wrong) are run through the real speculative path (drafter forwards, one
verify forward, acceptance, KV commit and drafter settle) many times from the same prompt. The
joint distribution of the first two tokens a round produces is compared with the target's exact
p(t1) · p(t2 | t1) by a chi-square test with a fixed seed: for a chain drafted from the drafter's
own distribution (Leviathan/Chen), and for a top-k tree (multi-draft point masses). A deliberately
wrong rule — on rejection, resample from p instead of the residual max(0, p − q) — must fail the
same test, so passing it means something.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from polylane import catalog
from polylane.policy.speculation.control import SpeculationConfig
from polylane.policy.speculation.tree import TreeShape
from polylane.runtime.kv.model_kv import Extend, ModelKV
from polylane.runtime.loading.loaded_model import LoadedModel
from polylane.runtime.model.model_config import GLOBAL, ModelConfig
from polylane.runtime.models.llama import LlamaModel
from polylane.runtime.sampling.sampler import RequestSampler
from polylane.runtime.speculation import verify as spec_verify
from polylane.runtime.speculation.drafters import ModelDrafter
from polylane.runtime.speculation.generate import split_rows
from polylane.runtime.speculation.speculator import SpecRequest, Speculator
from polylane.types import SamplingParams

VOCAB = 6
PROMPT = (1, 4, 2, 5, 3)
SAMPLES = 2000
BATCH = 250
MIN_P_VALUE = 1e-3  # a correct rule fails this with probability 1e-3 (fixed seeds: never flaky)


def tiny_model(seed: int, name: str) -> LoadedModel:
    config = ModelConfig(
        architecture="llama",
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        max_context=128,
        layer_types=(GLOBAL,) * 2,
        tie_embeddings=True,
    )
    generator = torch.Generator().manual_seed(seed)
    module = LlamaModel(config)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.35)
        for name_, parameter in module.named_parameters():
            if "norm" in name_:
                parameter.fill_(1.0)
    module.prepare()
    module.eval()
    source = catalog.ModelSource(name=name, path=None, format="synthetic")  # type: ignore[arg-type]
    return LoadedModel(name, source, config, module, None, torch.float32, 0, 0.0)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def models() -> tuple[LoadedModel, LoadedModel]:
    return tiny_model(1, "tiny-target"), tiny_model(2, "tiny-drafter")


def exact_joint(target: LoadedModel, params: SamplingParams) -> torch.Tensor:
    """(V, V): p(t1) · p(t2 | t1) after PROMPT, with the request's filters (the sampler's own
    distribution)."""
    kv = ModelKV(target, num_blocks=64, block_size=4, prefix_cache=False)
    sampler = RequestSampler(params)
    base = kv.open(PROMPT)
    first = sampler.probabilities(kv.forward([Extend(base, PROMPT)])[0])
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for t1 in range(VOCAB):
        fork = kv.fork(base)
        second = sampler.probabilities(kv.forward([Extend(fork, (t1,))])[0])
        joint[t1] = first[t1].double() * second.double()
        kv.close(fork, cache=False)
    kv.close(base, cache=False)
    return joint


def speculative_pairs(
    target: LoadedModel, drafter_model: LoadedModel, shape: TreeShape, params: SamplingParams, seed: int
) -> tuple[torch.Tensor, ModelKV, ModelKV, int]:
    """Counts (V, V) of the first two tokens produced by speculation after PROMPT; the two KVs
    (for the leak check) and the number of draft tokens accepted."""
    kv = ModelKV(target, num_blocks=2048, block_size=4, prefix_cache=False)
    draft_kv = ModelKV(drafter_model, num_blocks=2048, block_size=4, prefix_cache=False)
    config = SpeculationConfig(drafters=("tiny-drafter",), shape=shape, adaptive=False)
    speculator = Speculator(target.name, config)
    speculator.add_drafter(
        ModelDrafter("tiny-drafter", "model", draft_kv, target.name, speculator.monitor), 0.5
    )
    base = kv.open(PROMPT)
    kv.forward([Extend(base, PROMPT[:-1], logits="none")])  # the last prompt token goes in as "last"
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    accepted = 0
    request_id = 0
    for batch_start in range(0, SAMPLES, BATCH):
        samplers, sequences, produced = [], [], []
        for i in range(BATCH):
            sampler = RequestSampler(
                SamplingParams(**{**params.__dict__, "seed": seed * 1_000_003 + batch_start + i})
            )
            samplers.append(sampler)
            sequences.append(kv.fork(base))
            produced.append([])
        ids = list(range(request_id, request_id + BATCH))
        request_id += BATCH
        active = list(range(BATCH))
        while active:
            requests = [
                SpecRequest(
                    ids[i],
                    sequences[i],
                    [*sequences[i].token_ids, ([PROMPT[-1]] + produced[i])[-1]],
                    samplers[i],
                    max_new=8,
                )
                for i in active
            ]
            verify = speculator.prepare(requests, batch_size=len(active))
            assert len(verify) == len(active)
            extends = [verify[ids[i]] for i in active]
            rows = split_rows(extends, kv.forward(extends))
            for i, row in zip(active, rows, strict=True):
                new = speculator.finish(kv, ids[i], row)
                accepted += len(new) - 1
                produced[i].extend(new)
            active = [i for i in active if len(produced[i]) < 2]
        for i in range(BATCH):
            counts[produced[i][0], produced[i][1]] += 1
            speculator.drop(ids[i])
            kv.close(sequences[i], cache=False)
    kv.close(base, cache=False)
    return counts, kv, draft_kv, accepted


def chi_square_p(counts: torch.Tensor, joint: torch.Tensor) -> float:
    expected = joint.flatten() / joint.sum() * counts.sum()
    observed = counts.flatten()
    keep = expected >= 5  # pool the rare cells into one
    observed_kept = torch.cat([observed[keep], observed[~keep].sum(0, keepdim=True)])
    expected_kept = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)])
    if expected_kept[-1] < 5:  # nothing (or little) pooled
        observed_kept[-2] += observed_kept[-1]
        expected_kept[-2] += expected_kept[-1]
        observed_kept, expected_kept = observed_kept[:-1], expected_kept[:-1]
    return float(chisquare(observed_kept.numpy(), expected_kept.numpy()).pvalue)


CASES = [
    ("chain drafted from q", TreeShape.chain(3), SamplingParams(temperature=1.0)),
    ("top-k tree", TreeShape.topk(2, 2, 1), SamplingParams(temperature=0.8, top_k=4)),
]


@pytest.mark.parametrize(("label", "shape", "params"), CASES, ids=[c[0] for c in CASES])
def test_speculative_sampling_has_the_target_distribution(models, label, shape, params, record_property):
    target, drafter = models
    joint = exact_joint(target, params)
    counts, kv, draft_kv, accepted = speculative_pairs(target, drafter, shape, params, seed=11)
    p_value = chi_square_p(counts, joint)
    share = accepted / SAMPLES
    record_property(f"{label} p_value", p_value)
    print(f"{label}: chi-square p = {p_value:.3g} over {SAMPLES} samples, {share:.2f} drafts accepted/sample")
    assert accepted > SAMPLES // 10, f"{label}: too few drafts accepted ({accepted}) to test anything"
    assert p_value > MIN_P_VALUE, f"{label}: sampled pairs do not follow the target (p = {p_value:.3g})"
    assert kv.pool.num_free == kv.pool.num_blocks, "target blocks leaked"
    assert draft_kv.pool.num_free == draft_kv.pool.num_blocks, "drafter blocks leaked"


def test_a_wrong_rule_fails_the_same_test(models, monkeypatch):
    """On rejection, sample from p itself instead of the residual: biased towards drafted tokens."""
    target, drafter = models
    params = SamplingParams(temperature=1.0)
    monkeypatch.setattr(spec_verify.TensorDistribution, "residual", lambda self, draft, token: self)
    joint = exact_joint(target, params)
    counts, *_ = speculative_pairs(target, drafter, TreeShape.chain(3), params, seed=11)
    p_value = chi_square_p(counts, joint)
    print(f"wrong rule: chi-square p = {p_value:.3g}")
    assert p_value < 1e-6, f"the wrong rule passed the distribution test (p = {p_value:.3g})"
