"""Speculative acceptance rules: which draft tokens the target keeps, and the token it adds.

What this module owns: the decision, for one request, of how far into a verified draft tree (a
chain is a tree with one branch) the target's own choices agree with the draft, in vLLM's words:

- accepted tokens: draft tokens the target keeps, a root-to-node path of the tree;
- recovered token: the target's own token where it stopped agreeing (a rejection);
- bonus token: the target's next token after a fully accepted path (the path reached a leaf).

Every round therefore yields len(accepted) + 1 tokens.

Two rules, both lossless:

- `accept_greedy` (temperature 0): walk from the committed prefix; at each node the target's
  argmax is compared with the node's children in order; a child carrying that token is accepted.
  The output is token-identical to plain greedy decoding.
- `accept_sampled` (temperature > 0): recursive rejection sampling. At a node with target
  distribution p, the children are tried in order; child i, drafted from distribution q_i, is
  accepted when u·q_i(x_i) < p(x_i) for a fresh uniform u (probability min(1, p/q_i): Leviathan
  et al. 2023, Chen et al. 2023); a rejection replaces p by the residual norm(max(0, p − q_i))
  and the next child is tried (multi-draft speculative sampling as in SpecInfer). When every
  child is rejected the recovered token is drawn from the last residual; at a leaf the bonus
  token is drawn from p itself. The output token has exactly the target's distribution when each
  child was drafted from its q_i given its earlier siblings: i.i.d. draws from one q (SpecInfer),
  draws without replacement (q_i = q with earlier siblings removed, renormalised), or a
  deterministic choice such as the drafter's top-k (q_i = a point mass on x_i, passed as None:
  then the accept probability is p(x_i) and the residual is p with x_i removed).

The rules see token ids, scalar probabilities and uniform draws only. Distributions are reached
through the small `Distribution` protocol, so the runtime backs them with tensors and the tests
with lists (`ListDistribution`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from polylane.policy.kv.sequence_blocks import validate_tree


@dataclass(frozen=True)
class Acceptance:
    """The outcome of verifying one draft tree.

    path: accepted node indexes, root to node (empty when the first token was rejected).
    tokens: the accepted tokens followed by the recovered or bonus token (len(path) + 1).
    bonus: True when the path reached a leaf (the last token is a bonus token), False when the
        last token was recovered at a rejection.
    """

    path: tuple[int, ...]
    tokens: tuple[int, ...]
    bonus: bool

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    @property
    def next_token(self) -> int:
        return self.tokens[-1]


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """Node → its children in index order; key -1 is the committed prefix (the root)."""
    children: dict[int, list[int]] = {-1: []}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
        children.setdefault(node, [])
    return children


def accept_greedy(
    parents: Sequence[int], tokens: Sequence[int], root_choice: int, choices: Sequence[int]
) -> Acceptance:
    """Greedy acceptance over a draft tree.

    root_choice: the target's argmax after the committed prefix; choices[i]: its argmax after
    node i (only nodes on the accepted path are read).
    """
    _check_tree(parents, tokens)
    if len(choices) != len(tokens):
        raise ValueError(f"{len(choices)} target choices for {len(tokens)} draft nodes")
    children = children_of(parents)
    node, choice, path = -1, root_choice, []
    while True:
        match = next((child for child in children[node] if tokens[child] == choice), None)
        if match is None:
            break
        path.append(match)
        node, choice = match, choices[match]
    accepted = tuple(tokens[n] for n in path)
    return Acceptance(tuple(path), (*accepted, choice), bonus=not children[node])


class Distribution(Protocol):
    """A probability distribution over token ids, as the sampled rule needs it."""

    def prob(self, token: int) -> float:
        """Probability of `token`."""
        ...

    def residual(self, draft: Distribution | None, token: int) -> Distribution:
        """norm(max(0, self − draft)); `draft` None means a point mass on `token`."""
        ...

    def sample(self, uniform: float) -> int:
        """The token at cumulative probability `uniform` in [0, 1) (inverse-CDF draw)."""
        ...


def accepts(target_prob: float, draft_prob: float, uniform: float) -> bool:
    """The Leviathan/Chen test: accept with probability min(1, target_prob / draft_prob).

    `uniform` is a draw from [0, 1). Written without a division: a draft token with
    draft_prob = 0 (it cannot have been drawn) is accepted only if the target gives it mass.
    """
    return uniform * draft_prob < target_prob


def accept_sampled(
    parents: Sequence[int],
    tokens: Sequence[int],
    target: Callable[[int], Distribution],
    draft: Callable[[int], Distribution | None],
    uniform: Callable[[], float],
) -> Acceptance:
    """Recursive rejection sampling over a draft tree (see the module docstring).

    target(node): the target's distribution after `node` (-1: after the committed prefix); only
    nodes on the accepted path, and the root, are asked for.
    draft(child): the distribution `child`'s token was drafted from, or None for a point mass
    (a deterministic choice such as top-k).
    uniform(): a fresh draw from [0, 1); one per tried child and one for the final token.
    """
    _check_tree(parents, tokens)
    children = children_of(parents)
    node, path = -1, []
    while True:
        p = target(node)
        accepted = None
        for child in children[node]:
            token = tokens[child]
            q = draft(child)
            draft_prob = 1.0 if q is None else q.prob(token)
            if accepts(p.prob(token), draft_prob, uniform()):
                accepted = child
                break
            p = p.residual(q, token)
        if accepted is None:
            final = p.sample(uniform())
            out = tuple(tokens[n] for n in path)
            return Acceptance(tuple(path), (*out, final), bonus=not children[node])
        path.append(accepted)
        node = accepted


class ListDistribution:
    """A `Distribution` over token ids 0..V-1 held as a list of floats (tests and references)."""

    def __init__(self, probs: Sequence[float]) -> None:
        total = float(sum(probs))
        if total <= 0 or any(p < 0 for p in probs):
            raise ValueError("a distribution needs non-negative mass summing to more than 0")
        self.probs = [float(p) / total for p in probs]

    def prob(self, token: int) -> float:
        return self.probs[token] if 0 <= token < len(self.probs) else 0.0

    def residual(self, draft: Distribution | None, token: int) -> ListDistribution:
        if draft is None:
            rest = list(self.probs)
            rest[token] = 0.0
        else:
            rest = [max(0.0, p - draft.prob(t)) for t, p in enumerate(self.probs)]
        if sum(rest) <= 0.0:  # p == q: a rejection had probability 0; keep p
            return self
        return ListDistribution(rest)

    def sample(self, uniform: float) -> int:
        cumulative = 0.0
        last = max(t for t, p in enumerate(self.probs) if p > 0)
        for token, p in enumerate(self.probs):
            cumulative += p
            if uniform < cumulative and p > 0:
                return token
        return last  # rounding: uniform at the very top of [0, 1)


def _check_tree(parents: Sequence[int], tokens: Sequence[int]) -> None:
    if len(parents) != len(tokens):
        raise ValueError(f"{len(parents)} parents for {len(tokens)} draft tokens")
    validate_tree(parents)


__all__ = [
    "Acceptance",
    "Distribution",
    "ListDistribution",
    "accept_greedy",
    "accept_sampled",
    "accepts",
    "children_of",
]
