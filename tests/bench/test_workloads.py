"""Workloads: seeded and reproducible, shaped as documented, prompts shipped with the package."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from polylane.bench import workloads
from polylane.bench.workloads import STRUCTURED_SCHEMA, BenchRequest, Phase, WorkloadOptions, build

MODELS = ("a", "b", "c")


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_same_arguments_same_requests_and_repeats_differ(name: str) -> None:
    options = WorkloadOptions(models=MODELS, seed=3)
    first, again = build(name, options, repeat=0), build(name, options, repeat=0)
    assert first.phases == again.phases
    other_repeat = build(name, options, repeat=1)
    users = [r.user for p in first.phases for r in p.requests]
    assert not set(users) & {r.user for p in other_repeat.phases for r in p.requests}, (
        "a repeat reuses a prompt, so a prefix cache would serve it from the previous repeat"
    )
    other_seed = build(name, WorkloadOptions(models=MODELS, seed=4), repeat=0)
    assert other_seed.phases != first.phases


@pytest.mark.parametrize(
    "category",
    ["chat", "code", "extraction", "summarisation", "code-edit", "repetitive", "creative", "system"],
)
def test_prompt_library_is_shipped_and_varied(category: str) -> None:
    entries = workloads.load_prompts(category)
    assert len(entries) >= 3, f"{category}: only {len(entries)} prompts"
    assert len({e.prompt for e in entries}) == len(entries), f"{category}: duplicate prompts"
    assert all(e.category == category for e in entries)
    if category == "system":
        assert all(len(e.prompt.split()) > 300 and len(e.questions) >= 4 for e in entries)
    with pytest.raises(ValueError):
        workloads.load_prompts("no-such-category")


def test_single_phases() -> None:
    workload = build(
        "single", WorkloadOptions(models=MODELS, requests=2, max_tokens=16, prompt_tokens=256, batch=4)
    )
    assert [p.name for p in workload.phases] == ["prefill", "decode", "batch-4"]
    prefill, decode, batch = workload.phases
    assert {r.model for p in workload.phases for r in p.requests} == {"a"}, "single runs the first model"
    assert all(r.max_tokens == 1 and not r.chat for r in prefill.requests)
    assert all(150 <= len(r.user.split()) <= 220 for r in prefill.requests)  # ~0.75 words per token
    assert prefill.concurrency == decode.concurrency == 1
    assert len(batch.requests) == 4 and batch.concurrency == 4
    assert all(r.max_tokens == 16 and r.ignore_eos and r.arrival_s == 0 for r in decode.requests)


def test_mix_follows_zipf_and_poisson() -> None:
    options = WorkloadOptions(models=MODELS, requests=3000, rate=4.0, concurrency=5, max_tokens=40)
    [phase] = build("mix", options).phases
    counts = Counter(r.model for r in phase.requests)
    expected = workloads.zipf_weights(3, 1.1)
    for model, weight in zip(MODELS, expected, strict=True):
        assert counts[model] / 3000 == pytest.approx(weight, abs=0.03)
    arrivals = [r.arrival_s for r in phase.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    mean_gap = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
    assert mean_gap == pytest.approx(1 / 4.0, rel=0.1)
    assert all(20 <= r.max_tokens <= 40 for r in phase.requests)
    assert set(Counter(r.category for r in phase.requests)) == set(workloads.MIX_CATEGORIES)
    assert phase.concurrency == 5


def test_zipf_weights_and_all_at_once_arrivals() -> None:
    weights = workloads.zipf_weights(3, 1.0)
    assert weights == pytest.approx([6 / 11, 3 / 11, 2 / 11])
    assert workloads.poisson_arrivals(4, 0.0, random.Random(0)) == [0.0] * 4


def test_shared_prefix_requests_share_long_system_prompts_within_a_repeat() -> None:
    options = WorkloadOptions(models=("a",), requests=12, prefixes=2)
    [phase] = build("shared-prefix", options).phases
    systems = Counter(r.system for r in phase.requests)
    assert len(systems) == 2 and min(systems.values()) >= 2
    assert all(len(s.split()) > 300 for s in systems)  # type: ignore[union-attr]
    request = phase.requests[0]
    assert request.messages()[0] == {"role": "system", "content": request.system}
    assert request.text().startswith(request.system)  # type: ignore[arg-type]
    [next_repeat] = build("shared-prefix", options, repeat=1).phases
    assert not set(systems) & {r.system for r in next_repeat.requests}


def test_spec_has_one_phase_per_category_all_to_the_target() -> None:
    workload = build("spec", WorkloadOptions(models=("target", "drafter"), requests=5))
    assert (
        [p.name for p in workload.phases] == list(workloads.SPEC_CATEGORIES) == ["code", "chat", "extraction"]
    )
    for phase in workload.phases:
        assert {r.category for r in phase.requests} == {phase.name}
        assert {r.model for r in phase.requests} == {"target"}, "the other models only draft"
        assert len(phase.requests) == 5 and phase.concurrency == 1
        assert all(not r.ignore_eos for r in phase.requests)
    chosen = build("spec", WorkloadOptions(models=("t",), requests=2, categories=("repetitive", "creative")))
    assert [p.name for p in chosen.phases] == ["repetitive", "creative"]
    with pytest.raises(ValueError):
        WorkloadOptions(models=("t",), categories=("no-such-kind",))


def test_structured_asks_the_same_prompts_free_and_under_a_schema() -> None:
    workload = build("structured", WorkloadOptions(models=("target", "other"), requests=3))
    free, constrained = workload.phases
    assert (free.name, constrained.name) == ("free", "json")
    assert all(r.model == "target" and not r.ignore_eos for p in workload.phases for r in p.requests)
    assert all(r.json_schema is None for r in free.requests)
    assert all(json.loads(r.json_schema) == STRUCTURED_SCHEMA for r in constrained.requests)
    prompt = [r.user.split(") ", 1)[1] for r in free.requests]
    assert prompt == [r.user.split(") ", 1)[1] for r in constrained.requests]  # the same prompts
    assert not {r.user for r in free.requests} & {r.user for r in constrained.requests}  # other tags


def test_cross_model_shared_prefix_prefills_on_the_provider_first() -> None:
    options = WorkloadOptions(
        models=("provider", "sibling", "alias"), requests=3, prompt_tokens=2000, cross_model=True
    )
    workload = build("shared-prefix", options)
    assert [p.name for p in workload.phases] == ["sibling", "alias"]
    assert workload.options.max_tokens == 1 and workload.options.requests == 3
    for phase in workload.phases:
        assert phase.concurrency == 1 and len(phase.requests) == 9
        kinds = []
        for i in range(3):
            provider, first, second = phase.requests[3 * i : 3 * i + 3]
            assert provider.model == "provider" and provider.category == "provider"
            by_kind = {first.category: first, second.category: second}
            assert set(by_kind) == {"shared", "cold"}
            assert by_kind["shared"].model == by_kind["cold"].model == phase.name
            assert by_kind["shared"].text() == provider.text(), "the consumer gets the provider's prompt"
            assert by_kind["cold"].text() != provider.text()
            assert 1300 <= len(provider.text().split()) <= 1600  # ~0.75 words per token
            assert not provider.chat and provider.max_tokens == 1
            kinds.append(first.category)
        assert kinds == ["shared", "cold", "shared"], "the order alternates, so drift hits both alike"
    texts = [r.text() for p in workload.phases for r in p.requests if r.category != "shared"]
    assert len(set(texts)) == len(texts), "every provider and cold prompt is new"
    with pytest.raises(ValueError):
        WorkloadOptions(models=("provider",), cross_model=True)


def test_phase_only_scales_concurrency_to_the_model_share() -> None:
    requests = tuple(BenchRequest(f"r{i}", "a" if i < 6 else "b", "chat", "hi", 4) for i in range(8))
    phase = Phase("mix", requests, concurrency=4)
    assert len(phase.only("a").requests) == 6 and phase.only("a").concurrency == 3
    assert phase.only("b").concurrency == 1
    assert Phase("p", requests, 0).only("a").concurrency == 0
    assert Phase.from_dict(phase.to_dict()) == phase


def test_options_are_checked() -> None:
    with pytest.raises(ValueError):
        WorkloadOptions(models=())
    with pytest.raises(ValueError):
        WorkloadOptions(models=("a",), requests=0)
    with pytest.raises(ValueError):
        WorkloadOptions(models=("a",), rate=-1.0)
    with pytest.raises(ValueError):
        build("nonsense", WorkloadOptions(models=("a",)))
