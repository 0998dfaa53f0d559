"""StepPlan → forward passes → sampled tokens → StepResult: the tensor side of an engine step.

What this module owns: the leases the engine holds on resident models, each running request's
tokens and sampler, and the execution of one plan. Per model touched by the plan, the plan's block
copies are made, then one forward pass runs its prefill chunks (and, for the lane owner, one
decode token of each of its requests) through `ModelKV.forward` over the block tables the plan
gives (`ModelKV.planned`: the scheduler chose and reserved every slot; the runner allocates
nothing); rows that end a prompt or decode are sampled. A request admitted this step may first
import its prompt's prefix from a peer model sharing its lower layers (`LayerShare.extend`).

A decode forward runs inside `LaneMonitor.enter/exit`, so the number of models decoding at once is
counted where it happens. A failure of a forward fails the requests in it, with the error, and
nothing else: the other models' forwards in the step and the engine go on.

Speculation: when the lane owner has a `Speculator` (attached by the engine with the leases on its
drafters' models), its decoding requests first go through `Speculator.prepare` inside the lane
slot (drafter forwards are counted there as `drafter@target`), each with as many draft tokens as
the slots its table reserved allow; a speculating request's decode token is replaced by its verify
extend in the same single forward, and `Speculator.finish` turns its rows into one or more tokens
(the first in `StepResult.tokens`, the rest in `extra_tokens`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from polylane.policy.scheduling.lane import LaneMonitor
from polylane.runtime.kv.model_kv import Extend, KVSequence, ModelKV
from polylane.runtime.residency.manager import ModelLease
from polylane.runtime.sampling.grammar import Constraint
from polylane.runtime.sampling.sampler import RequestSampler, sample_rows
from polylane.runtime.sharing.layer_share import LayerShare
from polylane.runtime.speculation.generate import split_rows
from polylane.runtime.speculation.speculator import SpecRequest, Speculator
from polylane.types import BlockTable, SamplingParams, StepPlan, StepResult

log = logging.getLogger(__name__)


@dataclass(eq=False)
class RunningRequest:
    id: int
    model: str
    prompt_ids: tuple[int, ...]
    sampler: RequestSampler
    generated: list[int] = field(default_factory=list)
    kv: KVSequence | None = None  # this step's view of its KV (the plan's table)
    speculate: bool = True  # may speculate when its model has a speculator

    def prefill_tokens(self) -> tuple[int, ...]:
        """The tokens to prefill: the prompt, and after a preemption what was generated too."""
        return self.prompt_ids + tuple(self.generated)


@dataclass
class _Work:
    request: RunningRequest
    extend: Extend
    chunk: int | None = None  # prefill chunk size; None for a decode


class Runner:
    def __init__(self, monitor: LaneMonitor | None = None, sharing: LayerShare | None = None) -> None:
        self.monitor = monitor or LaneMonitor()
        self.sharing = sharing or LayerShare()  # cross-model prefill share (`runtime.sharing.layer_share`)
        self.leases: dict[str, ModelLease] = {}
        self.requests: dict[int, RunningRequest] = {}
        # speculation: per target model, its speculator and the leases on its drafters' models
        self.speculators: dict[str, Speculator] = {}
        self.drafter_leases: dict[str, list[ModelLease]] = {}

    # ------------------------------------------------------------------ leases and requests

    def attach(self, lease: ModelLease) -> None:
        if lease.name in self.leases:
            lease.release()  # already held: keep one lease per model
            return
        self.leases[lease.name] = lease
        self.sharing.attach(lease.name, lease.kv)

    def attach_speculator(
        self, target: str, speculator: Speculator, drafter_leases: Sequence[ModelLease]
    ) -> None:
        """Speculate for `target` (leased here) with drafters over `drafter_leases`' models; the
        leases are given back when the target is detached."""
        self.detach_speculator(target)
        self.speculators[target] = speculator
        self.drafter_leases[target] = list(drafter_leases)

    def add_drafter_lease(self, target: str, lease: ModelLease) -> None:
        self.drafter_leases.setdefault(target, []).append(lease)

    def detach_speculator(self, target: str) -> None:
        speculator = self.speculators.pop(target, None)
        if speculator is not None:
            speculator.close()
        for lease in self.drafter_leases.pop(target, []):
            lease.release()

    def detach(self, name: str) -> None:
        self.detach_speculator(name)
        lease = self.leases.pop(name, None)
        if lease is not None:
            lease.release()

    def detach_all(self) -> None:
        for request_id in list(self.requests):
            self.finish(request_id, cache=False)
        for name in list(self.leases):
            self.detach(name)

    def add(
        self,
        request_id: int,
        model: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        constraint: Constraint | None = None,
    ) -> None:
        self.requests[request_id] = RunningRequest(
            request_id,
            model,
            tuple(prompt_ids),
            RequestSampler(params, constraint),
            # a seeded sampled request reproduces its tokens only on plain decoding's draws
            speculate=params.speculation is not False and (params.greedy or params.seed is None),
        )

    def finish(self, request_id: int, *, cache: bool) -> None:
        """Forget a request (its KV is the scheduler's to let go); its drafters' sequences enter
        their prefix caches only with `cache` (completed requests)."""
        request = self.requests.pop(request_id, None)
        if request is not None and (speculator := self.speculators.get(request.model)) is not None:
            speculator.drop(request_id, cache=cache)

    # ------------------------------------------------------------------ one step

    def execute(self, plan: StepPlan) -> StepResult:
        result = StepResult(plan.step)
        for request_id, _reason, _message in plan.close:
            self.finish(request_id, cache=False)
        for request_id in plan.preempted:
            self._preempted(request_id)
        tables = {table.request_id: table for table in plan.tables}
        by_model: dict[str, list[tuple[RunningRequest, BlockTable, int | None]]] = {}
        for work in plan.prefill:
            request = self.requests[work.request_id]
            by_model.setdefault(work.model, []).append((request, tables[request.id], work.max_tokens))
        for request_id in plan.decode:
            request = self.requests[request_id]
            by_model.setdefault(request.model, []).append((request, tables[request_id], None))
        for model, items in by_model.items():
            decoding = model == plan.decode_model and bool(plan.decode)
            if decoding:
                self.monitor.enter(model)
            try:
                self._run_model(model, items, result, decoding)
            finally:
                if decoding:
                    self.monitor.exit(model)
                for request, _, _ in items:
                    request.kv = None  # the table was this step's
        for model in plan.release:
            self.detach(model)
        return result

    def _run_model(
        self,
        model: str,
        items: list[tuple[RunningRequest, BlockTable, int | None]],
        result: StepResult,
        decoding: bool,
    ) -> None:
        kv = self._kv(model)
        verify: dict[int, Extend] = {}
        speculator = self.speculators.get(model) if decoding else None
        try:
            kv.cache.copy_blocks([copy for _, table, _ in items for copy in table.copies])
            work = [self._extend(kv, request, table, chunk) for request, table, chunk in items]
            if speculator is not None:
                verify = self._prepare_speculation(speculator, work)
            started = time.perf_counter()
            logits = kv.forward([w.extend for w in work])
            seconds = time.perf_counter() - started
        except Exception as error:  # a broken forward fails its own requests, nothing else
            log.exception("forward of %s failed", model)
            message = f"model {model!r} failed in a forward pass: {type(error).__name__}: {error}"
            if verify:
                speculator.cancel(list(verify))  # type: ignore[union-attr]
            for request, _, _ in items:
                result.failed[request.id] = message
                self.finish(request.id, cache=False)
            return
        if verify or speculator is not None:
            rows = split_rows([w.extend for w in work], logits)
            self._finish_speculation(kv, speculator, work, rows, verify, seconds, result)  # type: ignore[arg-type]
            plain = [
                (w, row)
                for w, row in zip(work, rows, strict=True)
                if w.extend.logits != "none"
                and w.request.id not in verify
                and w.request.id not in result.failed
            ]
            sampled = [w for w, _ in plain]
            logits = torch.cat([row[-1:] for _, row in plain]) if plain else logits[:0]
        else:
            sampled = [w for w in work if w.extend.logits != "none"]
        tokens = self._sample(model, logits, sampled, result) if sampled else []
        for w, token in zip(sampled, tokens, strict=True):
            if token is None:
                continue
            w.request.generated.append(token)
            result.tokens[w.request.id] = token
        for w in work:
            if w.request.id not in result.failed:
                result.computed[w.request.id] = w.request.kv.num_tokens  # type: ignore[union-attr]
                if w.request.sampler.logprobs:
                    result.logprobs[w.request.id] = w.request.sampler.take_logprobs()

    # ------------------------------------------------------------------ speculation

    def _prepare_speculation(self, speculator: Speculator, work: list[_Work]) -> dict[int, Extend]:
        """Drafts for the decoding requests that may speculate; their verify extends replace
        their decode extends in `work` (inside the target's lane slot: the caller entered it)."""
        decoding = [w for w in work if w.chunk is None]
        candidates = [w for w in decoding if w.request.speculate]
        if not candidates:
            return {}
        kv = self._kv(candidates[0].request.model)
        context_limit = kv.model.config.max_context
        requests = []
        for w in candidates:
            request = w.request
            sequence = request.kv
            assert sequence is not None
            # a verify pass writes at most `max_new` tokens: within the slots the plan reserved
            left = min(request.sampler.params.max_tokens - len(request.generated), sequence.blocks.room)
            room = context_limit - sequence.num_tokens - 1
            requests.append(
                SpecRequest(
                    request.id,
                    sequence,
                    [*sequence.token_ids, request.generated[-1]],
                    request.sampler,
                    max(0, min(left, room)),
                )
            )
        verify = speculator.prepare(requests, batch_size=len(decoding))
        for w in candidates:
            if w.request.id in verify:
                w.extend = verify[w.request.id]
        return verify

    def _finish_speculation(
        self,
        kv: ModelKV,
        speculator: Speculator,
        work: list[_Work],
        rows: list[torch.Tensor],
        verify: dict[int, Extend],
        seconds: float,
        result: StepResult,
    ) -> None:
        """Accept each verified draft; its tokens go to `result` (the first in `tokens`, the rest
        in `extra_tokens`). A decode-only forward's time feeds the controller's cost model."""
        if all(w.chunk is None for w in work):
            drafters = sorted({d for d in (speculator.round_drafter(i) for i in verify) if d})
            speculator.record_forward(sum(len(w.extend.token_ids) for w in work), seconds, drafters)
        for w, row in zip(work, rows, strict=True):
            request = w.request
            if request.id not in verify:
                continue
            try:
                forced_before = speculator.forced_tokens
                new = speculator.finish(kv, request.id, row)
                result.forced_tokens += speculator.forced_tokens - forced_before
            except Exception as error:  # its own request fails, nothing else
                log.exception("speculative acceptance failed for request %d", request.id)
                result.failed[request.id] = f"speculation failed: {type(error).__name__}: {error}"
                self.finish(request.id, cache=False)
                continue
            request.generated.extend(new)
            result.tokens[request.id] = new[0]
            if len(new) > 1:
                result.extra_tokens[request.id] = tuple(new[1:])

    def _sample(
        self, model: str, logits: torch.Tensor, sampled: list[_Work], result: StepResult
    ) -> list[int | None]:
        """One token per sampled row; a row whose sampler fails fails its own request only."""
        try:
            return list(sample_rows(logits, [w.request.sampler for w in sampled]))
        except Exception:
            log.exception("batched sampling of %s failed; sampling row by row", model)
        tokens: list[int | None] = []
        for i, w in enumerate(sampled):
            try:
                tokens.append(sample_rows(logits[i : i + 1], [w.request.sampler])[0])
            except Exception as error:
                result.failed[w.request.id] = f"sampling failed: {type(error).__name__}: {error}"
                self.finish(w.request.id, cache=False)
                tokens.append(None)
        return tokens

    def _extend(self, kv: ModelKV, request: RunningRequest, table: BlockTable, chunk: int | None) -> _Work:
        tokens = request.prefill_tokens()
        request.kv = kv.planned(table.blocks, tokens[: table.num_tokens], table.cached or 0)
        if chunk is None:  # decode: the last sampled token goes in, the next comes out
            return _Work(request, Extend(request.kv, (request.generated[-1],)))  # chunk None: decode
        if table.cached is not None:  # admitted this step: a peer may hold more of the prompt
            self.sharing.extend(request.model, kv, request.kv, tokens)
        done = request.kv.num_tokens
        end = min(len(tokens), done + chunk)
        logits = "last" if end == len(tokens) else "none"
        return _Work(request, Extend(request.kv, tokens[done:end], logits=logits), chunk)

    def _preempted(self, request_id: int) -> None:
        request = self.requests[request_id]
        if (speculator := self.speculators.get(request.model)) is not None:
            speculator.drop(request_id)
        log.info("preempted request %d of %s (KV full); it will prefill again", request_id, request.model)

    def _kv(self, model: str) -> ModelKV:
        lease = self.leases.get(model)
        if lease is None:
            raise RuntimeError(f"model {model!r} holds no lease in the runner")
        return lease.kv
