"""Tests for polylane.runtime.sampling.sampler: greedy, seeding, the filters, and the distribution drawn."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polylane.runtime.sampling.sampler import RequestSampler, sample_rows
from polylane.types import SamplingParams

# probs [0.5, 0.3, 0.15, 0.05] as log-probs: the known distribution for the filter tests.
KNOWN = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()

# chi-square critical value for df = 5 at p = 1e-4 (scipy.stats.chi2.isf(1e-4, 5) = 25.7448).
CHI2_CRIT_DF5 = 25.7448


def _sampler(**kw: object) -> RequestSampler:
    return RequestSampler(SamplingParams(**kw))  # type: ignore[arg-type]


def _random_logits(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 3.0


def _support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs).flatten().tolist())


def _draws(sampler: RequestSampler, logits: torch.Tensor, n: int) -> list[int]:
    return [sampler.sample(logits) for _ in range(n)]


def _chi_square_p(counts: list[int], expected_probs: list[float]) -> tuple[float, float]:
    """(statistic, p-value); p-value is nan when scipy is missing."""
    total = sum(counts)
    expected = [p * total for p in expected_probs]
    stat = sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True))
    try:
        from scipy.stats import chi2
    except ImportError:
        return stat, math.nan
    return stat, float(chi2.sf(stat, len(counts) - 1))


def _assert_fits(counts: list[int], expected_probs: list[float]) -> None:
    assert len(counts) == 6, "the hard-coded critical value is for df = 5"
    stat, p_value = _chi_square_p(counts, expected_probs)
    if math.isnan(p_value):
        assert stat < CHI2_CRIT_DF5, (
            f"chi-square {stat:.2f} >= {CHI2_CRIT_DF5} (df=5, p=1e-4); "
            f"counts {counts}, expected probs {expected_probs}"
        )
    else:
        assert p_value > 1e-4, (
            f"chi-square {stat:.2f}, p-value {p_value:.3g} <= 1e-4; "
            f"counts {counts}, expected probs {expected_probs}"
        )


# --- greedy and seeding -------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    sampler = _sampler()
    for i, row in enumerate(_random_logits(20, 1000, seed=0)):
        want = int(torch.argmax(row))
        got = sampler.sample(row)
        assert got == want, f"row {i}: greedy picked {got}, argmax is {want}"
        probs = sampler.probabilities(row)
        assert probs.dtype == torch.float32
        assert _support(probs) == {want}, f"row {i}: greedy support {_support(probs)}"
        assert float(probs[want]) == 1.0


def test_greedy_ties_pick_lowest_index() -> None:
    logits = torch.tensor([0.0, 2.0, 1.0, 2.0, 2.0])
    got = _sampler().sample(logits)
    assert got == 1, f"tie between 1, 3, 4 resolved to {got}"
    assert sample_rows(logits[None], [_sampler()]) == [1]


def test_accepts_half_precision_logits() -> None:
    row = _random_logits(1, 64, seed=1)[0]
    for dtype in (torch.float16, torch.bfloat16):
        low = row.to(dtype)
        want = int(torch.argmax(low.float()))
        assert _sampler().sample(low) == want, f"{dtype}: greedy disagrees with argmax {want}"
        probs = _sampler(temperature=1.0, top_k=10).probabilities(low)
        assert probs.dtype == torch.float32, f"{dtype}: probabilities dtype {probs.dtype}"
        assert abs(float(probs.sum()) - 1.0) < 1e-5, f"{dtype}: sums to {float(probs.sum())}"


def test_same_seed_same_draws() -> None:
    rows = _random_logits(50, 200, seed=2) / 3.0  # fairly flat: many tokens in play
    a = _sampler(temperature=1.0, seed=1234)
    b = _sampler(temperature=1.0, seed=1234)
    draws_a = [a.sample(r) for r in rows]
    draws_b = [b.sample(r) for r in rows]
    assert draws_a == draws_b, f"same seed diverged: {draws_a} vs {draws_b}"
    assert len(set(draws_a)) > 10, f"only {len(set(draws_a))} distinct tokens in 50 draws"


def test_different_seeds_differ() -> None:
    rows = _random_logits(50, 200, seed=3) / 3.0
    a = _sampler(temperature=1.0, seed=1)
    b = _sampler(temperature=1.0, seed=2)
    draws_a = [a.sample(r) for r in rows]
    draws_b = [b.sample(r) for r in rows]
    same = sum(x == y for x, y in zip(draws_a, draws_b, strict=True))
    assert same < 25, f"seeds 1 and 2 agreed on {same}/50 draws"


def test_unseeded_samplers_differ() -> None:
    flat = torch.zeros(1000)
    draws_a = _draws(_sampler(temperature=1.0), flat, 50)
    draws_b = _draws(_sampler(temperature=1.0), flat, 50)
    assert draws_a != draws_b, "two unseeded samplers drew identical sequences"


# --- top-k --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.05, 0.7, 1.0, 5.0, 100.0])
def test_top_k_one_is_greedy(temperature: float) -> None:
    sampler = _sampler(temperature=temperature, top_k=1, seed=7)
    for i, row in enumerate(_random_logits(30, 500, seed=4)):
        want = int(torch.argmax(row))
        got = sampler.sample(row)
        assert got == want, f"T={temperature} row {i}: top_k=1 picked {got}, argmax {want}"


def test_top_k_stays_in_top_k() -> None:
    k = 5
    row = _random_logits(1, 50, seed=5)[0]
    top = set(torch.topk(row, k).indices.tolist())
    sampler = _sampler(temperature=3.0, top_k=k, seed=8)  # flatten so the tail would show up
    assert _support(sampler.probabilities(row)) == top
    draws = _draws(sampler, row, 3000)
    outside = [t for t in draws if t not in top]
    assert not outside, f"{len(outside)}/3000 draws outside the top {k}: {sorted(set(outside))}"
    assert set(draws) == top, f"top {k} is {sorted(top)} but only {sorted(set(draws))} drawn"


def test_top_k_larger_than_vocab_is_off() -> None:
    probs = _sampler(temperature=1.0, top_k=100).probabilities(KNOWN)
    assert torch.allclose(probs, KNOWN.exp(), atol=1e-6), f"got {probs.tolist()}"


# --- top-p and min-p ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top_p", "want"),
    [(0.5, {0}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (0.95, {0, 1, 2}), (0.96, {0, 1, 2, 3})],
)
def test_top_p_keeps_smallest_prefix(top_p: float, want: set[int]) -> None:
    sampler = _sampler(temperature=1.0, top_p=top_p, seed=9)
    probs = sampler.probabilities(KNOWN)
    assert _support(probs) == want, f"top_p={top_p}: kept {_support(probs)}, want {want}"
    base = KNOWN.exp()
    expected = torch.zeros(4)
    idx = sorted(want)
    expected[idx] = base[idx] / base[idx].sum()
    assert torch.allclose(probs, expected, atol=1e-6), f"top_p={top_p}: {probs.tolist()}"
    drawn = set(_draws(sampler, KNOWN, 2000))
    assert drawn == want, f"top_p={top_p}: drew {drawn}, want {want}"


def test_top_p_tiny_keeps_top_token() -> None:
    probs = _sampler(temperature=1.0, top_p=1e-9).probabilities(KNOWN)
    assert _support(probs) == {0}, f"kept {_support(probs)}"


@pytest.mark.parametrize(("min_p", "want"), [(0.5, {0, 1}), (0.2, {0, 1, 2}), (1.0, {0})])
def test_min_p(min_p: float, want: set[int]) -> None:
    sampler = _sampler(temperature=1.0, min_p=min_p, seed=10)
    probs = sampler.probabilities(KNOWN)
    assert _support(probs) == want, f"min_p={min_p}: kept {_support(probs)}, want {want}"
    drawn = set(_draws(sampler, KNOWN, 2000))
    assert drawn == want, f"min_p={min_p}: drew {drawn}, want {want}"


def test_top_p_applies_to_top_k_renormalised() -> None:
    # top_k=2 leaves [0.625, 0.375]; top_p=0.6 then keeps only token 0. Applied to the
    # unfiltered distribution, top_p=0.6 would have kept tokens 0 and 1.
    probs = _sampler(temperature=1.0, top_k=2, top_p=0.6).probabilities(KNOWN)
    assert _support(probs) == {0}, f"kept {_support(probs)}, want {{0}}"


def test_filters_apply_after_temperature() -> None:
    # At T=0.5 the distribution is proportional to p**2: [0.25, 0.09, 0.0225, 0.0025] / 0.365
    # = [0.685, 0.247, 0.062, 0.007]; top_p=0.9 keeps {0, 1} (0.932), whereas at T=1 it
    # would need {0, 1, 2}.
    probs = _sampler(temperature=0.5, top_p=0.9).probabilities(KNOWN)
    assert _support(probs) == {0, 1}, f"kept {_support(probs)}, want {{0, 1}}"


# --- the distribution actually drawn ------------------------------------------------------

SIX = [0.3, 0.25, 0.2, 0.12, 0.08, 0.05]


def _counts(sampler: RequestSampler, logits: torch.Tensor, n: int) -> list[int]:
    draws = torch.tensor(_draws(sampler, logits, n))
    return torch.bincount(draws, minlength=logits.shape[0]).tolist()


def test_temperature_one_matches_softmax() -> None:
    logits = torch.tensor(SIX).log() + 4.0  # shift: softmax must not care
    sampler = _sampler(temperature=1.0, seed=11)
    probs = sampler.probabilities(logits)
    assert torch.allclose(probs, torch.tensor(SIX), atol=1e-6), f"probabilities {probs.tolist()}"
    _assert_fits(_counts(sampler, logits, 20_000), SIX)


def test_temperature_half_matches_scaled_softmax() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.3, -1.0, 0.2])
    want = torch.softmax(logits / 0.5, dim=-1)
    sampler = _sampler(temperature=0.5, seed=12)
    probs = sampler.probabilities(logits)
    assert torch.allclose(probs, want, atol=1e-6), f"{probs.tolist()} vs {want.tolist()}"
    _assert_fits(_counts(sampler, logits, 20_000), want.tolist())


def test_chi_square_rejects_wrong_distribution() -> None:
    # The goodness-of-fit check must be able to fail: T=1 draws do not fit softmax(logits/0.5).
    logits = torch.tensor([1.0, 0.5, 0.0, -0.3, -1.0, 0.2])
    counts = _counts(_sampler(temperature=1.0, seed=13), logits, 20_000)
    with pytest.raises(AssertionError):
        _assert_fits(counts, torch.softmax(logits / 0.5, dim=-1).tolist())


# --- batches ------------------------------------------------------------------------------


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_k=20, seed=2),
        SamplingParams(),
        SamplingParams(temperature=1.3, top_p=0.9, min_p=0.05, seed=3),
        SamplingParams(temperature=2.0, top_k=50, top_p=0.8, seed=4),
    ]


def test_sample_rows_matches_per_row_sample() -> None:
    params = _mixed_params()
    batched = [RequestSampler(p) for p in params]
    single = [RequestSampler(p) for p in params]
    for step, logits in enumerate(_random_logits(10 * len(params), 300, seed=14).split(6)):
        got = sample_rows(logits, batched)
        want = [s.sample(row) for s, row in zip(single, logits, strict=True)]
        assert got == want, f"step {step}: batch {got} vs per-row {want}"


def test_sample_rows_all_greedy() -> None:
    logits = _random_logits(8, 300, seed=15).to(torch.bfloat16)
    got = sample_rows(logits, [_sampler() for _ in range(8)])
    want = [_sampler().sample(row) for row in logits]
    assert got == want, f"greedy batch {got} vs per-row {want}"
    assert all(isinstance(t, int) for t in got)


def test_sample_rows_shape_mismatch() -> None:
    with pytest.raises(ValueError):
        sample_rows(torch.zeros(3, 10), [_sampler(), _sampler()])
    with pytest.raises(ValueError):
        _sampler().sample(torch.zeros(2, 10))


# --- properties ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(1, 64),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_k=st.integers(0, 70),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_probabilities_is_a_distribution_that_sample_respects(
    seed: int, vocab: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    row = _random_logits(1, vocab, seed=seed)[0]
    sampler = _sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    probs = sampler.probabilities(row)
    support = _support(probs)
    assert probs.shape == (vocab,) and probs.dtype == torch.float32
    assert abs(float(probs.sum()) - 1.0) < 1e-5, f"sums to {float(probs.sum())}"
    assert bool((probs >= 0).all())
    assert int(torch.argmax(row)) in support, f"argmax {int(torch.argmax(row))} filtered out"
    if top_k:
        assert len(support) <= top_k, f"{len(support)} tokens survive top_k={top_k}"
    for _ in range(5):
        token = sampler.sample(row)
        assert token in support, f"drew {token} outside support {sorted(support)}"


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30, 9.9e-5])
def test_a_vanishing_temperature_samples_greedily_instead_of_overflowing(temperature: float) -> None:
    logits = _random_logits(3, 50, seed=11)
    sampler = _sampler(temperature=temperature, seed=3)
    assert sampler.greedy
    assert sample_rows(logits, [sampler] * 3) == logits.argmax(dim=-1).tolist()
    assert [sampler.sample(row) for row in logits] == logits.argmax(dim=-1).tolist()


def _reference_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The module docstring's recipe with a full stable sort of the vocabulary, no shortcuts."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if 0 < params.top_k < probs.shape[0]:
        head, order = torch.topk(probs, params.top_k, sorted=True)
    else:
        head, order = torch.sort(probs, descending=True, stable=True)
    keep = head.shape[0]
    if params.top_p < 1.0:
        cum = torch.cumsum(head, dim=0, dtype=torch.float64)
        keep = min(keep, int(torch.searchsorted(cum, params.top_p * float(cum[-1]) - 1e-6)) + 1)
    if params.min_p > 0.0:
        keep = min(keep, int((head[:keep] >= params.min_p * float(head[0])).sum()))
    keep = max(keep, 1)
    out = torch.zeros_like(probs)
    out[order[:keep]] = head[:keep] / head[:keep].sum()
    return out


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 12.0])  # flat (cut far out) to peaked (cut early)
@pytest.mark.parametrize(
    "filters", [{"top_p": 0.9}, {"top_p": 0.5}, {"min_p": 0.05}, {"top_p": 0.95, "min_p": 0.01}]
)
@pytest.mark.parametrize("vocab", [5000, 49152])
def test_the_shortcuts_give_the_full_sort_distribution(scale: float, filters: dict, vocab: int) -> None:
    """The partial top-k head (peaked rows) and the probability buckets (flat rows) against a
    full stable sort, with ties at the top and a run of equal values wherever the cut may land."""
    for seed in range(5):
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale
        logits[7] = logits[8] = logits.max()  # a tie at the top
        logits[100:400] = logits[1000]  # many equal tokens: the cut may fall among them
        params = SamplingParams(temperature=0.8, **filters)
        got = RequestSampler(params).probabilities(logits)
        want = _reference_probabilities(logits, params)
        assert _support(got) == _support(want)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
