"""Speculation under a grammar (structured outputs): drafts cut to what the grammar allows, the
tokens it forces put first, and the verify rows masked position by position.

What this module owns: the grammar's side of one speculative round of a greedy request.

- `constrain_draft`: the tokens the grammar forces from here (a JSON key, its quotes and colon)
  start the draft, taken from no model (jump-forward: verified in the same pass as drafted tokens,
  and always accepted); the drafter's tokens follow only where its chain agrees with them. Every
  node the grammar forbids after its parent's path is cut with its subtree, so no forbidden token
  is ever proposed.
- `masked_rows`: each verify row masked with the grammar's state after its node's path, so
  acceptance compares the draft with the argmax plain constrained decoding would take.

For a greedy request the cut changes nothing (a forbidden token could never equal the masked
argmax): the output is plain constrained greedy decoding's. For a sampled one it changes nothing
either where the draft is a proposal without a distribution (prompt lookup, and the forced tokens):
a forbidden token has probability 0 under the masked target, so it would be rejected for sure and
the residual draw would be the target's own distribution, which is what a draft cut before it
draws. A model drafter's sampled draft has a distribution q, and cutting it would change the
residual (p − q)⁺; so a sampled request under a grammar drafts only by prompt lookup
(`Speculator.prepare`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from polylane.policy.speculation.tree import DraftTree
from polylane.runtime.sampling.grammar import Constraint
from polylane.runtime.speculation.drafters import DraftJob


class _Walk:
    """Moves a constraint's state from one token path to another, rolling back only what differs
    (the state depends on the tokens alone), and back to where it began with `home`."""

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint
        self.path: list[int] = []

    def go(self, path: Sequence[int]) -> None:
        common = 0
        while common < min(len(self.path), len(path)) and self.path[common] == path[common]:
            common += 1
        self.constraint.rollback(len(self.path) - common)
        self.constraint.accept_all(list(path[common:]))
        self.path = list(path)

    def home(self) -> None:
        self.constraint.rollback(len(self.path))
        self.path = []


def _paths(tree: DraftTree) -> list[list[int]]:
    """Each node's tokens from the committed prefix down to it (parents come before children)."""
    paths: list[list[int]] = []
    for node, parent in enumerate(tree.parents):
        paths.append([*(paths[parent] if parent >= 0 else []), tree.token_ids[node]])
    return paths


def constrain_draft(job: DraftJob, constraint: Constraint, limit: int) -> int:
    """Rewrite `job.tree` as the grammar allows it (module docstring), at most `limit` tokens; the
    number of forced tokens at its start."""
    forced = constraint.forced_tokens()[:limit]
    tree = job.tree
    if forced:
        drafted = list(tree.token_ids) if tree.is_chain else []
        agrees = drafted[: len(forced)] == forced
        tokens = drafted[:limit] if agrees else forced
        kept = constraint.valid_prefix(tokens)
        job.candidates = {n: c for n, c in job.candidates.items() if agrees and n < kept}
        job.tree = DraftTree.chain(tokens[:kept])
        job.draft_probs = {}
        return len(forced)
    if not len(tree):
        return 0
    walk, keep = _Walk(constraint), []
    kept_index: dict[int, int] = {}
    try:
        for node, path in enumerate(_paths(tree)):
            parent = tree.parents[node]
            if parent >= 0 and parent not in kept_index:
                continue
            walk.go(path[:-1])
            if constraint.valid_prefix(path[-1:]) == 1:
                kept_index[node] = len(keep)
                keep.append(node)
    finally:
        walk.home()
    if len(keep) == len(tree):
        return 0
    job.tree = DraftTree(
        tuple(tree.token_ids[n] for n in keep),
        tuple(kept_index[tree.parents[n]] if tree.parents[n] >= 0 else -1 for n in keep),
        tuple(tree.probs[n] for n in keep),
        tuple(tree.confidence[n] for n in keep),
        tuple(tree.ranks[n] for n in keep),
        tuple(tree.depths[n] for n in keep),
    )
    job.candidates = {
        (kept_index[n] if n >= 0 else -1): c for n, c in job.candidates.items() if n < 0 or n in kept_index
    }
    job.draft_probs = {}
    return 0


def masked_rows(rows: torch.Tensor, tree: DraftTree, constraint: Constraint) -> torch.Tensor:
    """A copy of the verify rows (1 + len(tree), V), row 0 masked with the grammar's state now and
    row i + 1 with its state after node i's path."""
    rows = rows.detach().to(device="cpu", dtype=torch.float32, copy=True)
    constraint.mask(rows[0])
    walk = _Walk(constraint)
    try:
        for node, path in enumerate(_paths(tree)):
            walk.go(path)
            constraint.mask(rows[node + 1])
    finally:
        walk.home()
    return rows


__all__ = ["constrain_draft", "masked_rows"]
