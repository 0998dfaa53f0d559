"""Acceptance rules by hand: exact tokens for chains and trees (accepted, recovered, bonus), and
the sampled rule's output distribution computed exactly on tiny vocabularies."""

from __future__ import annotations

import itertools
import random

import pytest

from polylane.policy.speculation.accept import (
    Acceptance,
    ListDistribution,
    accept_greedy,
    accept_sampled,
    accepts,
    children_of,
)

CHAIN3 = (-1, 0, 1)
# root → 0 (a) and 1 (b); 0 → 2, 3; 1 → 4; 2 → 5
TREE = (-1, -1, 0, 0, 1, 2)


def test_greedy_chain_all_accepted_gives_a_bonus_token():
    result = accept_greedy(CHAIN3, (10, 11, 12), root_choice=10, choices=(11, 12, 13))
    assert result == Acceptance((0, 1, 2), (10, 11, 12, 13), bonus=True)
    assert result.num_accepted == 3 and result.next_token == 13


def test_greedy_chain_rejection_recovers_the_target_token():
    result = accept_greedy(CHAIN3, (10, 11, 12), root_choice=10, choices=(99, 12, 13))
    assert result == Acceptance((0,), (10, 99), bonus=False)


def test_greedy_chain_first_token_rejected():
    result = accept_greedy(CHAIN3, (10, 11, 12), root_choice=7, choices=(11, 12, 13))
    assert result == Acceptance((), (7,), bonus=False)


def test_greedy_empty_draft_is_plain_decode():
    assert accept_greedy((), (), root_choice=5, choices=()) == Acceptance((), (5,), bonus=True)


def test_greedy_tree_follows_the_matching_sibling():
    tokens = (20, 21, 30, 31, 40, 50)
    # the target picks 21 (node 1, the second sibling), then 40 (node 4), then 41 after node 4
    result = accept_greedy(TREE, tokens, root_choice=21, choices=(30, 40, 50, 0, 41, 0))
    assert result == Acceptance((1, 4), (21, 40, 41), bonus=True)
    # through node 0 then node 3 (the second child), 3 is a leaf: bonus
    result = accept_greedy(TREE, tokens, root_choice=20, choices=(31, 0, 0, 77, 0, 0))
    assert result == Acceptance((0, 3), (20, 31, 77), bonus=True)
    # node 2 accepted, then its child 5 rejected: recovered
    result = accept_greedy(TREE, tokens, root_choice=20, choices=(30, 0, 51, 0, 0, 0))
    assert result == Acceptance((0, 2), (20, 30, 51), bonus=False)


def test_greedy_rejects_bad_input():
    with pytest.raises(ValueError, match="parent"):
        accept_greedy((0,), (1,), 1, (1,))
    with pytest.raises(ValueError, match="parents for"):
        accept_greedy((-1,), (1, 2), 1, (1, 2))
    with pytest.raises(ValueError, match="choices"):
        accept_greedy((-1,), (1,), 1, ())


def test_children_of():
    assert children_of(TREE) == {-1: [0, 1], 0: [2, 3], 1: [4], 2: [5], 3: [], 4: [], 5: []}


def test_accepts_is_min_one_p_over_q():
    assert accepts(0.5, 0.25, 0.99)  # p > q: always
    assert accepts(0.2, 0.4, 0.49) and not accepts(0.2, 0.4, 0.5)  # p/q = 0.5
    assert not accepts(0.0, 0.4, 0.0)  # no target mass: never
    assert accepts(0.1, 0.0, 0.9)  # q = 0 could not have been drawn; p > 0 accepts


class _Draws:
    def __init__(self, values):
        self.values = list(values)

    def __call__(self):
        return self.values.pop(0)


def test_sampled_chain_exact_tokens():
    p = ListDistribution([0.1, 0.6, 0.3])
    q = ListDistribution([0.2, 0.2, 0.6])
    after = ListDistribution([0.0, 0.0, 1.0])
    target = {-1: p, 0: after}.__getitem__
    # node 0 drafts token 2: p/q = 0.5; u = 0.4 accepts; then the bonus from `after`: token 2
    result = accept_sampled((-1,), (2,), target, lambda c: q, _Draws([0.4, 0.5]))
    assert result == Acceptance((0,), (2, 2), bonus=True)
    # u = 0.6 rejects; residual max(0, p - q) = [0, 0.4, 0] → token 1 whatever the draw
    result = accept_sampled((-1,), (2,), target, lambda c: q, _Draws([0.6, 0.99]))
    assert result == Acceptance((), (1,), bonus=False)


def test_sampled_point_mass_residual_removes_the_rejected_token():
    p = ListDistribution([0.5, 0.3, 0.2])
    # two deterministic children 0 and 1: accept 0 w.p. 0.5; else 1 w.p. 0.3 / 0.5; else token 2
    draws = _Draws([0.7, 0.7, 0.1])
    result = accept_sampled((-1, -1), (0, 1), {-1: p}.__getitem__, lambda c: None, draws)
    assert result == Acceptance((), (2,), bonus=False)
    result = accept_sampled(
        (-1, -1),
        (0, 1),
        {-1: p, 1: ListDistribution([1, 0, 0])}.__getitem__,
        lambda c: None,
        _Draws([0.7, 0.5, 0.0]),
    )
    assert result == Acceptance((1,), (1, 0), bonus=True)


def _exact_output_distribution(parents, tokens, target, draft_of, vocab, draws, grid):
    """P(first produced token), enumerating the uniform draws on a grid of midpoints (one
    dimension per draw the rule may take)."""
    counts = [0.0] * vocab
    points = [(i + 0.5) / grid for i in range(grid)]
    for combo in itertools.product(points, repeat=draws):
        result = accept_sampled(parents, tokens, target, draft_of, _Draws(combo))
        counts[result.tokens[0]] += 1
    total = sum(counts)
    return [c / total for c in counts]


@pytest.mark.parametrize("seed", range(3))
def test_sampled_first_token_has_the_target_distribution(seed):
    rng = random.Random(seed)
    vocab = 4
    p = ListDistribution([rng.random() + 0.05 for _ in range(vocab)])
    q = ListDistribution([rng.random() + 0.05 for _ in range(vocab)])
    target = lambda node: p  # noqa: E731 (after an accepted node, any distribution will do)
    # a one-token chain drafted from q: Σ_x q(x) · P(output | drafted x) must be p
    mix = [0.0] * vocab
    for drafted in range(vocab):
        out = _exact_output_distribution((-1,), (drafted,), target, lambda c: q, vocab, draws=2, grid=100)
        for t in range(vocab):
            mix[t] += q.prob(drafted) * out[t]
    assert max(abs(a - b) for a, b in zip(mix, p.probs, strict=True)) < 0.02, (mix, p.probs)
    # two deterministic siblings (point masses): the output is exactly p
    out = _exact_output_distribution((-1, -1), (1, 3), target, lambda c: None, vocab, draws=3, grid=30)
    assert max(abs(a - b) for a, b in zip(out, p.probs, strict=True)) < 0.04, (out, p.probs)


def test_list_distribution_sampling_and_residual():
    d = ListDistribution([0.0, 2.0, 2.0])
    assert d.probs == [0.0, 0.5, 0.5]
    assert [d.sample(u) for u in (0.0, 0.49, 0.5, 0.999999)] == [1, 1, 2, 2]
    assert d.residual(None, 1).probs == [0.0, 0.0, 1.0]
    assert d.residual(ListDistribution([0, 1, 1]), 1) is d  # p == q: nothing left, keep p
    with pytest.raises(ValueError):
        ListDistribution([0.0, 0.0])
