"""Speculative decoding for one target model's decode batch: decide, draft, verify, commit.

What this module owns: the round of every speculating request of one target model, between the
controller (`policy.speculation.control`, which decides), the drafters (`runtime.speculation.drafters`, which
propose) and the target's one verify forward (`runtime.speculation.verify`). A round, inside the
target's decode-lane slot:

1. `prepare(requests, batch_size)`: the controller picks, per request, a drafter and a shape, or
   nothing (plain decode). Each drafter drafts for all of its requests at once (one forward per
   depth); the result is one verify `Extend` per speculating request, which the caller puts in
   the same target forward as everything else of the step (prefill chunks, plain decode tokens).
2. `finish(kv, request, rows)`: the acceptance rule over the request's logits rows; the accepted
   path is kept in the target's KV (rollback or compaction), the drafter settles on the committed
   tokens (its rejected KV rolled back), statistics go to the controller. Returns the round's
   tokens (accepted + recovered or bonus), at least one.
3. `cancel(requests)`: the forward did not run (e.g. the KV pool was full): the drafts are
   dropped, the drafters go back to where they were, the caller decodes plainly.
4. `drop(request)`: the request is done: its drafter state is let go.

It holds no lease: the engine gives it drafters over leased models and takes them back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from polylane.policy.scheduling.lane import LaneMonitor
from polylane.policy.speculation.accept import Acceptance
from polylane.policy.speculation.control import (
    DrafterInfo,
    PairStats,
    SpecController,
    SpecDecision,
    SpeculationConfig,
)
from polylane.policy.speculation.cost import SpecMeasurements
from polylane.policy.speculation.tree import TreeShape
from polylane.runtime.kv.model_kv import Extend, KVSequence, ModelKV
from polylane.runtime.sampling.sampler import RequestSampler
from polylane.runtime.speculation.drafters import Drafter, DraftJob, NgramDrafter
from polylane.runtime.speculation.grammar import constrain_draft, masked_rows
from polylane.runtime.speculation.verify import accept_rows, commit, verify_extend

log = logging.getLogger(__name__)


@dataclass
class SpecRequest:
    """What a round needs to know about one decoding request.

    context: every token so far (prompt and generated); the last has no target KV yet.
    max_new: tokens the request may still produce (max_tokens left, and room in the context).
    """

    id: int
    sequence: KVSequence
    context: Sequence[int]
    sampler: RequestSampler
    max_new: int


@dataclass
class _Round:
    """One request's pending round; drafter and decision None: the grammar's forced tokens alone."""

    request: SpecRequest
    drafter: Drafter | None
    decision: SpecDecision | None
    job: DraftJob
    base: int
    extend: Extend
    forced: int = 0  # tokens at the draft's start that the grammar forces (always accepted)


class Speculator:
    def __init__(
        self,
        target: str,
        config: SpeculationConfig,
        monitor: LaneMonitor | None = None,
        pairs: dict[str, PairStats] | None = None,
        costs: SpecMeasurements | None = None,
    ) -> None:
        """`pairs`, `costs`: statistics and measurements to continue (kept by the engine across
        reloads of the target)."""
        self.target = target
        self.config = config
        self.monitor = monitor or LaneMonitor()
        self.controller = SpecController(target, config, pairs, costs)
        self.drafters: dict[str, Drafter] = {}
        self._rounds: dict[int, _Round] = {}
        self._warned: set[tuple[str, type]] = set()
        self._shadows: dict[tuple[int, str], tuple[int, list[int]]] = {}  # (request, drafter) → guess
        self.forced_tokens = 0  # tokens a grammar forced, verified without any drafter's forward

    # ------------------------------------------------------------------ drafters

    def add_drafter(self, drafter: Drafter, relative_cost: float) -> None:
        """Use `drafter` (its cost prior: seconds per drafter forward over a target decode step)."""
        self.drafters[drafter.name] = drafter
        self.controller.add_drafter(DrafterInfo(drafter.name, drafter.kind, relative_cost))

    def remove_drafter(self, name: str) -> Drafter | None:
        """Stop using a drafter (its model is going away); its per-request state is let go."""
        drafter = self.drafters.pop(name, None)
        if drafter is not None:
            for request_id in [i for i, r in self._rounds.items() if r.drafter is drafter]:
                del self._rounds[request_id]
            drafter.drop_all()
        return drafter

    def close(self) -> None:
        for name in list(self.drafters):
            self.remove_drafter(name)

    @property
    def stats(self) -> dict[str, PairStats]:
        return self.controller.pairs

    # ------------------------------------------------------------------ a round

    def prepare(self, requests: Sequence[SpecRequest], batch_size: int) -> dict[int, Extend]:
        """Decide and draft; the verify extend of every request that speculates this round."""
        if not self.drafters:
            return {}
        if self.controller.plain_step_due(batch_size):  # measure the baseline now and then
            for request in requests:
                self._shadow(request)
            return {}
        chosen: dict[str, list[tuple[SpecRequest, SpecDecision]]] = {}
        extends: dict[int, Extend] = {}
        for request in requests:
            limit = request.max_new - 1  # the target adds one token of its own
            # a drafter whose own context would overflow cannot draft for this request, nor can
            # prompt lookup where nothing matches (the controller's n-gram rates are given a match)
            length = len(request.context)
            available = [
                n
                for n, d in self.drafters.items()
                if d.room(length) > limit
                and d.ready(request.id, request.context)
                and (_drafts_deterministically(d) or not _sampled_under_grammar(request))
            ]
            catch_up = {n: self.drafters[n].catch_up(request.id, length) for n in available}
            decision = self.controller.decide(request.id, available, batch_size, limit, catch_up)
            if decision is not None:
                chosen.setdefault(decision.drafter, []).append((request, decision))
            elif (forced := self._forced_round(request, limit)) is not None:
                extends[request.id] = forced
            else:
                self._shadow(request)
        for name, items in chosen.items():
            drafter = self.drafters[name]
            jobs = [DraftJob(r.id, r.context, d.shape, r.sampler) for r, d in items]
            started = time.perf_counter()
            try:
                forwards = drafter.draft(jobs)
            except Exception as error:  # a drafter failure costs this round's speculation, nothing else
                if (name, type(error)) not in self._warned:  # once per drafter and kind of error
                    self._warned.add((name, type(error)))
                    log.exception("drafter %s failed for %s; decoding plainly this round", name, self.target)
                for request, _ in items:
                    drafter.settle(request.id, request.context)
                continue
            seconds = time.perf_counter() - started
            timed = getattr(drafter, "timed", None)
            if timed is not None:  # a model drafter times its draft steps, prompt prefill apart
                self.controller.record_draft_cost(name, seconds, 0)
                self.controller.record_draft_step_cost(name, *timed)
                self.controller.record_draft_prefill(name, *drafter.prefill_timed)
            else:
                self.controller.record_draft_cost(name, seconds, forwards)
            for (request, decision), job in zip(items, jobs, strict=True):
                constraint, forced = request.sampler.constraint, 0
                if constraint is not None:
                    forced = constrain_draft(job, constraint, request.max_new - 1)
                base = request.sequence.num_tokens
                extend = verify_extend(request.sequence, request.context[-1], job.tree)
                self._rounds[request.id] = _Round(request, drafter, decision, job, base, extend, forced)
                extends[request.id] = extend
        return extends

    def _forced_round(self, request: SpecRequest, limit: int) -> Extend | None:
        """Where no drafter drafts but the request's grammar forces its next tokens: a round of
        those tokens alone (jump-forward); its verify extend, or None."""
        constraint = request.sampler.constraint
        if constraint is None or limit < 1:
            return None
        job = DraftJob(request.id, request.context, TreeShape.chain(limit), request.sampler)
        forced = constrain_draft(job, constraint, limit)
        if not forced:
            return None
        base = request.sequence.num_tokens
        extend = verify_extend(request.sequence, request.context[-1], job.tree)
        self._rounds[request.id] = _Round(request, None, None, job, base, extend, forced)
        return extend

    def _shadow(self, request: SpecRequest) -> None:
        """A plain step for `request`: score what each free drafter (n-gram) would have proposed
        last step against the token that came, and note what it proposes now."""
        for name, drafter in self.drafters.items():
            if not isinstance(drafter, NgramDrafter):
                continue
            key = (request.id, name)
            length = len(request.context)
            previous = self._shadows.pop(key, None)
            if previous is not None and previous[0] == length - 1 and previous[1]:
                produced = request.context[-1]
                rank = previous[1].index(produced) if produced in previous[1] else None
                self.controller.record_shadow(request.id, name, rank)
            self._shadows[key] = (length, drafter.first_candidates(request.id, request.context, 2))

    def finish(
        self, kv: ModelKV, request_id: int, rows: torch.Tensor, greedy_choices: list[int] | None = None
    ) -> list[int]:
        """After the verify forward: accept, commit the KV, settle the drafter; the new tokens."""
        round_ = self._rounds.pop(request_id)
        request, job = round_.request, round_.job
        constraint = request.sampler.constraint
        if request.sampler.shapes_logits:  # each row as plain decoding would see it
            rows, greedy_choices = rows.detach().to(device="cpu", dtype=torch.float32, copy=True), None
            request.sampler.bias(rows)
            if constraint is not None:
                rows = masked_rows(rows, job.tree, constraint)
        acceptance = accept_rows(rows, job.tree, request.sampler, job.draft_probs, greedy_choices)
        commit(kv, request.sequence, round_.base, job.tree, acceptance)
        if request.sampler.params.logprobs is not None:  # each token from its parent's row
            for k, token in enumerate(acceptance.tokens):
                request.sampler.record_logprob(rows[0 if k == 0 else acceptance.path[k - 1] + 1], token)
        if constraint is not None:
            constraint.accept_all(list(acceptance.tokens))
            self.forced_tokens += min(round_.forced, acceptance.num_accepted)
        if round_.drafter is not None:
            round_.drafter.settle(request_id, request.sequence.token_ids)
        drafted = len(job.tree) - round_.forced  # the forced tokens are no drafter's
        if round_.decision is None or drafted <= 0:  # nothing drafted (no n-gram match): a plain step
            return list(acceptance.tokens)
        self.controller.record_round(
            request_id,
            round_.decision.drafter,
            round_.decision.shape,
            drafted,
            max(0, acceptance.num_accepted - round_.forced),
            _rank_events(job, acceptance),
            job.tree.is_chain,
        )
        return list(acceptance.tokens)

    def round_drafter(self, request_id: int) -> str | None:
        """The drafter of the request's pending round (None: not speculating this round)."""
        round_ = self._rounds.get(request_id)
        return round_.decision.drafter if round_ is not None and round_.decision is not None else None

    def cancel(self, request_ids: Sequence[int]) -> None:
        """The verify forward did not run: drop these drafts (the target KV was not touched)."""
        for request_id in request_ids:
            round_ = self._rounds.pop(request_id, None)
            if round_ is not None and round_.drafter is not None:
                round_.drafter.settle(request_id, round_.request.context)

    def drop(self, request_id: int, *, cache: bool = False) -> None:
        """The request is done (finished, aborted, preempted): let go of its drafter state."""
        self._rounds.pop(request_id, None)
        for drafter in self.drafters.values():
            drafter.drop(request_id, cache=cache)
            self._shadows.pop((request_id, drafter.name), None)
        self.controller.forget(request_id)

    def record_forward(self, tokens: int, seconds: float, drafters: Sequence[str] = ()) -> None:
        """A target forward of the decode batch (no prefill in it): `tokens` rows computed."""
        self.controller.record_target_forward(tokens, seconds, drafters)


def _sampled_under_grammar(request: SpecRequest) -> bool:
    return request.sampler.constraint is not None and not request.sampler.greedy


def _drafts_deterministically(drafter: Drafter) -> bool:
    """Whether its drafts are proposals with no distribution of their own (prompt lookup): the only
    drafts a grammar may cut for a sampled request without changing what it samples
    (`runtime/speculation/grammar.py`)."""
    return isinstance(drafter, NgramDrafter)


def _rank_events(job: DraftJob, acceptance: Acceptance) -> list[tuple[int, int | None]]:
    """(depth of the children, rank of the target's token among the drafter's candidates) at
    every node of the walk that the drafter expanded."""
    events = []
    for index, node in enumerate((-1, *acceptance.path)):
        candidates = job.candidates.get(node)
        if candidates is None:
            continue
        produced = acceptance.tokens[index]
        rank = candidates.index(produced) if produced in candidates else None
        depth = (job.tree.depths[node] if node >= 0 else 0) + 1
        events.append((depth, rank))
    return events


__all__ = ["SpecRequest", "Speculator"]
