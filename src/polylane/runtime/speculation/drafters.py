"""Drafters: where a speculation round's draft tokens come from.

What this module owns: the drafters and their per-request state.

- `ModelDrafter`: a small model's forward passes over its own `ModelKV`. Used for (a) another
  resident model whose tokenizer is identical to the target's (`Tokenizer.digest`) and which
  streams fewer bytes per token, and (b) the target's quantised twin (`runtime.model.quantize`). It
  keeps one committed sequence per request; a round first feeds the drafter what it has not seen
  (the prompt on the first round, then the tokens the target produced since), then grows the draft
  depth by depth with a `TreeBuilder`, one drafter forward per depth over every request's
  frontier. Each frontier node runs on its own sequence: the first child of a node extends the
  node's sequence in place, the others fork it (shared blocks, copy-on-write of the last one), so
  every node's KV sits in a plain chain. After the target's verify, `settle` keeps the sequence
  that agrees longest with the committed tokens, rolls it back to that agreement (exact rollback)
  and closes the others: nothing is recomputed, nothing leaks.
- `NgramDrafter`: prompt lookup (`policy.speculation.ngram`) over the request's own tokens; no model.

Draft tokens: a greedy request gets the drafter's argmax (chain) or its top-k candidates (trees).
A sampled request gets, for a chain, tokens drawn from the drafter's distribution q (filtered with
the request's own temperature, top-k, top-p and min-p) and the q rows themselves for the
Leviathan test; for a tree, the top-k candidates of q as deterministic drafts (point masses),
which keeps multi-draft acceptance exact whatever shape the tree takes.

The drafter's forward passes are entered in the lane monitor as `drafter@target`, inside the
target's decode slot. Not thread-safe: the engine thread drives it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from polylane.policy.scheduling.lane import LaneMonitor
from polylane.policy.speculation.ngram import NgramIndex
from polylane.policy.speculation.tree import DraftTree, TreeBuilder, TreeShape
from polylane.runtime.kv.model_kv import Extend, KVSequence, ModelKV
from polylane.runtime.sampling.sampler import RequestSampler

RANKED_CANDIDATES = 4  # candidates per expanded node kept for the acceptance statistics
PREFILL_TOKENS = 8  # a catch-up longer than this per request is a prefill, not a draft step


@dataclass
class DraftJob:
    """One request's draft for this round: what goes in, and what the drafter fills in.

    context: every token of the request so far (prompt, generated; the last one has no target KV
        yet). shape: the tree shape to grow. sampler: the request's sampler (its params decide
        greedy vs sampled drafts; its generator draws the sampled draft tokens).
    tree: the draft. candidates: node (-1: the committed prefix) → the drafter's ranked
        candidate tokens there (for statistics). draft_probs: node → the q row its token was
        drawn from (sampled chains only; absent: a deterministic draft).
    """

    request_id: int
    context: Sequence[int]
    shape: TreeShape
    sampler: RequestSampler
    tree: DraftTree = field(default_factory=DraftTree.empty)
    candidates: dict[int, list[int]] = field(default_factory=dict)
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    forwards: int = 0


class ModelDrafter:
    """Drafts with a model (a smaller same-tokenizer model or the target's quantised twin)."""

    def __init__(self, name: str, kind: str, kv: ModelKV, target: str, monitor: LaneMonitor) -> None:
        self.name = name
        self.kind = kind  # "model" | "twin"
        self.kv = kv
        self.target = target
        self.monitor = monitor
        self._sequences: dict[int, KVSequence] = {}  # request → committed drafter sequence
        self._nodes: dict[int, dict[int, KVSequence]] = {}  # request → node → its sequence (a round)
        self._round_base: dict[int, int] = {}  # request → context length when the round began
        self.timed: tuple[int, float] = (0, 0.0)  # last draft: forwards timed (no prefill), seconds
        self.prefill_timed: tuple[int, float] = (0, 0.0)  # last draft: catch-up prefill tokens, seconds

    @property
    def lane_name(self) -> str:
        return f"{self.name}@{self.target}"

    def room(self, context_length: int) -> int:
        """Draft tokens the drafter's context has room for after `context_length` tokens."""
        return self.kv.model.config.max_context - context_length

    def catch_up(self, request_id: int, context_length: int) -> int:
        """Tokens it must run before drafting for this request (its whole context at first)."""
        sequence = self._sequences.get(request_id)
        return context_length - (sequence.num_tokens if sequence is not None else 0)

    def ready(self, request_id: int, context: Sequence[int]) -> bool:
        """Whether it has a draft to offer after `context` (a model always has)."""
        return True

    @property
    def num_requests(self) -> int:
        return len(self._sequences)

    def draft(self, jobs: Sequence[DraftJob]) -> int:
        """Fill every job's draft; returns the drafter forward passes run."""
        if not jobs:
            return 0
        self.monitor.enter(self.lane_name)
        try:
            return self._draft(jobs)
        finally:
            self.monitor.exit(self.lane_name)

    def _draft(self, jobs: Sequence[DraftJob]) -> int:
        builders = {job.request_id: TreeBuilder(job.shape) for job in jobs}
        extends, owners = [], []
        for job in jobs:
            sequence = self._sequences.get(job.request_id)
            if sequence is None:
                sequence = self.kv.open(job.context)
                self._sequences[job.request_id] = sequence
            if sequence.num_tokens >= len(job.context):
                raise RuntimeError(f"drafter {self.name}: request {job.request_id} is out of step")
            self._nodes[job.request_id] = {-1: sequence}
            self._round_base[job.request_id] = len(job.context)
            extends.append(Extend(sequence, tuple(job.context[sequence.num_tokens :])))
            owners.append((job, -1))
        forwards = 0
        # the first forward may prefill a new request's prompt: not a draft step's cost
        caught_up = sum(len(e.token_ids) for e in extends)
        catching_up = caught_up > PREFILL_TOKENS * len(extends)
        self.timed, self.prefill_timed = (0, 0.0), (0, 0.0)
        while extends:
            started = time.perf_counter()
            logits = self.kv.forward(extends)  # (R, V): one row per frontier node
            forwards += 1
            if catching_up and forwards == 1:
                self.prefill_timed = (caught_up, time.perf_counter() - started)
            else:
                timed_forwards, timed_seconds = self.timed
                self.timed = (timed_forwards + 1, timed_seconds + time.perf_counter() - started)
            for row, (job, node) in enumerate(owners):
                self._expand(job, builders[job.request_id], node, logits[row])
            extends, owners = self._next_depth(jobs, builders)
        for job in jobs:
            builder = builders[job.request_id]
            job.tree = builder.tree()
            job.forwards = forwards
            if builder.kept is not None:  # a pruned dynamic tree: renumber the bookkeeping
                renumber = {old: new for new, old in enumerate(builder.kept)}
                renumber[-1] = -1
                job.candidates = {renumber[n]: c for n, c in job.candidates.items() if n in renumber}
                job.draft_probs = {renumber[n]: q for n, q in job.draft_probs.items() if n in renumber}
        return forwards

    def _expand(self, job: DraftJob, builder: TreeBuilder, node: int, logits: torch.Tensor) -> None:
        sampler, width = job.sampler, job.shape.candidates_per_node
        if sampler.greedy:
            probs = torch.softmax(logits.float(), dim=-1)
            top = torch.topk(probs, max(width, RANKED_CANDIDATES))
            ranked = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            job.candidates[node] = [token for token, _ in ranked[:RANKED_CANDIDATES]]
            builder.expand(node, ranked[:width])
            return
        q = sampler.probabilities(logits)  # (V,) the request's filters applied to the drafter
        top = torch.topk(q, max(width, RANKED_CANDIDATES))
        job.candidates[node] = top.indices.tolist()[:RANKED_CANDIDATES]
        if job.shape.is_chain:
            token = int(torch.multinomial(q, 1, generator=sampler.generator))
            child = builder.num_nodes  # the node this expansion makes
            builder.expand(node, [(token, float(q[token]))])
            job.draft_probs[child] = q
            return
        ranked = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        builder.expand(node, [(t, p) for t, p in ranked[:width] if p > 0] or ranked[:1])

    def _next_depth(
        self, jobs: Sequence[DraftJob], builders: dict[int, TreeBuilder]
    ) -> tuple[list[Extend], list[tuple[DraftJob, int]]]:
        """Extends for every frontier node (its token on top of its parent's sequence)."""
        extends, owners = [], []
        for job in jobs:
            builder = builders[job.request_id]
            if builder.done:
                continue
            nodes = self._nodes[job.request_id]
            frontier = builder.frontier()
            by_parent: dict[int, list[int]] = {}
            for node in frontier:
                by_parent.setdefault(builder.parent(node), []).append(node)
            for parent, children in by_parent.items():
                base = nodes[parent]
                # forks first (they share the parent's blocks), then the last child takes it over
                for child in children[:-1]:
                    nodes[child] = self.kv.fork(base)
                nodes[children[-1]] = base
                for child in children:
                    extends.append(Extend(nodes[child], (builder.token(child),)))
                    owners.append((job, child))
        return extends, owners

    def settle(self, request_id: int, committed: Sequence[int]) -> None:
        """After the verify: keep the sequence agreeing longest with `committed` (the target's
        tokens with KV), rolled back to that agreement; close the round's other sequences."""
        nodes = self._nodes.pop(request_id, None)
        if nodes is None:
            return
        base = self._round_base.pop(request_id, 0)
        unique = list({id(s): s for s in nodes.values()}.values())
        best, best_length = None, -1
        for sequence in unique:
            length = _common_prefix(sequence.token_ids, committed, min(base, sequence.num_tokens))
            if length > best_length:
                best, best_length = sequence, length
        assert best is not None
        for sequence in unique:
            if sequence is not best:
                self.kv.close(sequence, cache=False)
        self.kv.rollback(best, best_length)
        self._sequences[request_id] = best

    def drop(self, request_id: int, *, cache: bool = False) -> None:
        """The request is done: let go of its drafter KV (the committed sequence enters the
        drafter's prefix tree with `cache`)."""
        nodes = self._nodes.pop(request_id, {})
        self._round_base.pop(request_id, None)
        sequence = self._sequences.pop(request_id, None)
        for other in {id(s): s for s in nodes.values()}.values():
            if other is not sequence and not other.closed:
                self.kv.close(other, cache=False)
        if sequence is not None and not sequence.closed:
            self.kv.close(sequence, cache=cache and sequence.pending is None)

    def drop_all(self) -> None:
        for request_id in list(self._sequences):
            self.drop(request_id)


class NgramDrafter:
    """Drafts by prompt lookup (`policy.speculation.ngram.NgramIndex`), one index per request."""

    kind = "ngram"

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3, name: str = "ngram") -> None:
        self.name = name
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._indexes: dict[int, NgramIndex] = {}

    @property
    def num_requests(self) -> int:
        return len(self._indexes)

    def room(self, context_length: int) -> int:
        return 1 << 30  # no model, no context limit

    def catch_up(self, request_id: int, context_length: int) -> int:
        return 0

    def ready(self, request_id: int, context: Sequence[int]) -> bool:
        """Whether some n-gram ending the context occurred before (else there is nothing to draft)."""
        return bool(self.first_candidates(request_id, context, 1))

    def draft(self, jobs: Sequence[DraftJob]) -> int:
        for job in jobs:
            index = self._indexes.get(job.request_id)
            if index is None:
                index = self._indexes[job.request_id] = NgramIndex(self.min_ngram, self.max_ngram)
            index.sync(job.context)
            branches = job.shape.branching[0] if job.shape.branching else 1
            job.tree = index.propose(job.shape.max_nodes, max_branches=branches, depth=job.shape.depth)
            job.candidates = _trie_candidates(job.tree)
            job.forwards = 1
        return 1

    def first_candidates(self, request_id: int, context: Sequence[int], branches: int) -> list[int]:
        """The tokens a draft would start with after `context` (for shadow scoring)."""
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.min_ngram, self.max_ngram)
        index.sync(context)
        return [c[0] for c in index.continuations(1, branches)]

    def settle(self, request_id: int, committed: Sequence[int]) -> None:
        pass  # the index catches up from the context next round

    def drop(self, request_id: int, *, cache: bool = False) -> None:
        self._indexes.pop(request_id, None)

    def drop_all(self) -> None:
        self._indexes.clear()


Drafter = ModelDrafter | NgramDrafter


def _trie_candidates(tree: DraftTree) -> dict[int, list[int]]:
    """Node → its children's tokens in order (the n-gram drafter's 'candidates')."""
    candidates: dict[int, list[int]] = {}
    if len(tree):
        candidates[-1] = []
    for node, parent in enumerate(tree.parents):
        candidates.setdefault(parent, []).append(tree.token_ids[node])
    return candidates


def _common_prefix(a: Sequence[int], b: Sequence[int], known: int = 0) -> int:
    """Length of the common prefix of a and b, given that their first `known` items agree."""
    limit = min(len(a), len(b))
    index = min(known, limit)
    while index < limit and a[index] == b[index]:
        index += 1
    return index


__all__ = ["DraftJob", "Drafter", "ModelDrafter", "NgramDrafter"]
