"""One-pass speculative verify: a draft as one target `Extend`, and acceptance over its logits.

What this module owns: the tensor side of verifying one request's draft.

- `verify_extend`: the request's last token (sampled, no KV yet) followed by the draft, as one
  extend of the target's sequence: a plain causal chain when the draft is a chain, else a token
  tree whose root is the last token (tree mask). Logits come back for every row: row 0 is the
  target after the last token (what the draft's first depth is checked against), row i + 1 the
  target after draft node i.
- `accept_rows`: the policy rule (`policy.speculation.accept`) over those rows: greedy on their
  argmaxes, or recursive rejection sampling with `TensorDistribution`s (the request's sampler
  turns a row into its filtered distribution, exactly the one plain decoding samples from).
- `commit`: the accepted path stays in the target's KV (a chain is rolled back past it; a tree's
  path is compacted into place), everything else is dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from polylane.policy.speculation.accept import Acceptance, accept_greedy, accept_sampled
from polylane.policy.speculation.tree import DraftTree
from polylane.runtime.kv.model_kv import Extend, KVSequence, ModelKV
from polylane.runtime.sampling.sampler import RequestSampler, greedy_tokens


class TensorDistribution:
    """A (V,) float32 probability row as a `policy.speculation.accept.Distribution`."""

    __slots__ = ("probs",)

    def __init__(self, probs: torch.Tensor) -> None:
        self.probs = probs

    def prob(self, token: int) -> float:
        return float(self.probs[token]) if 0 <= token < self.probs.shape[0] else 0.0

    def residual(self, draft: TensorDistribution | None, token: int) -> TensorDistribution:
        if draft is None:
            rest = self.probs.clone()
            if 0 <= token < rest.shape[0]:
                rest[token] = 0.0
        else:
            q = _fit(draft.probs, self.probs.shape[0])
            rest = (self.probs - q).clamp_min_(0.0)
        total = float(rest.sum())
        if total <= 0.0:  # p == q: a rejection had probability 0; keep p
            return self
        return TensorDistribution(rest / total)

    def sample(self, uniform: float) -> int:
        cumulative = torch.cumsum(self.probs, dim=0, dtype=torch.float64)
        index = int(
            torch.searchsorted(
                cumulative, torch.tensor([uniform * float(cumulative[-1])], dtype=torch.float64), right=True
            )
        )
        index = min(index, self.probs.shape[0] - 1)
        if float(self.probs[index]) <= 0.0:  # rounding at the top end: the last token with mass
            index = int(torch.nonzero(self.probs > 0)[-1])
        return index


def _fit(row: torch.Tensor, size: int) -> torch.Tensor:
    """A drafter's row padded (zeros) or cut to the target's vocabulary size."""
    if row.shape[0] == size:
        return row
    if row.shape[0] > size:
        return row[:size]
    return torch.cat([row, row.new_zeros(size - row.shape[0])])


def verify_extend(sequence: KVSequence, last_token: int, tree: DraftTree) -> Extend:
    """The target's extend that verifies `tree` after `last_token` (see the module docstring)."""
    tokens = (last_token, *tree.token_ids)
    if tree.is_chain:
        return Extend(sequence, tokens, logits="all")
    parents = (-1, *(parent + 1 for parent in tree.parents))
    return Extend(sequence, tokens, tree_parents=parents, logits="all")


def accept_rows(
    rows: torch.Tensor,
    tree: DraftTree,
    sampler: RequestSampler,
    draft_probs: dict[int, torch.Tensor],
    greedy_choices: list[int] | None = None,
) -> Acceptance:
    """Acceptance for one request: rows (1 + len(tree), V) from `verify_extend`'s forward.

    greedy_choices: the rows' argmaxes when the caller computed them for a whole batch.
    """
    if sampler.greedy:
        choices = greedy_choices if greedy_choices is not None else greedy_tokens(rows)
        return accept_greedy(tree.parents, tree.token_ids, choices[0], choices[1:])
    cache: dict[int, TensorDistribution] = {}

    def target(node: int) -> TensorDistribution:
        if node not in cache:
            cache[node] = TensorDistribution(sampler.probabilities(rows[node + 1]))
        return cache[node]

    def draft(child: int) -> TensorDistribution | None:
        q = draft_probs.get(child)
        return None if q is None else TensorDistribution(q)

    uniform: Callable[[], float] = lambda: float(torch.rand((), generator=sampler.generator))  # noqa: E731
    return accept_sampled(tree.parents, tree.token_ids, target, draft, uniform)


def commit(kv: ModelKV, sequence: KVSequence, base: int, tree: DraftTree, acceptance: Acceptance) -> None:
    """Keep the last token and the accepted path in the target's KV; drop the rest.

    base: the sequence's length before the verify extend.
    """
    if tree.is_chain:
        kv.rollback(sequence, base + 1 + acceptance.num_accepted)
    else:
        kv.accept(sequence, [0, *(node + 1 for node in acceptance.path)])


__all__ = ["TensorDistribution", "accept_rows", "commit", "verify_extend"]
