"""The online scheduler: which requests run, which models are leased, who owns the decode lane,
and where every request's KV lives.

What this module owns: every unfinished request's place in its life (waiting → prefill → decode →
gone), each model's lease state, its `KVManager` once leased (`policy/kv/manager.py`: the blocks of
every admitted request), chunked prefill under a per-step token budget, and the lane choice. It
turns that into one `StepPlan` per step — with each request's block table, the copies to make and
the requests preempted — and reads back one `StepResult`. Pure policy: no torch, no threads, no
clocks (steps are the clock).

Rules:
- A request waits until its model holds a lease (the plan asks the engine to `acquire` it) and its
  model's `KVManager` can hold its whole prompt (after its prefix-cache hit) and still keep one
  block per running request of the model, the new one included (a decode step may open a block),
  and its model runs fewer than `max_running` requests. Admission takes those blocks: prefill
  chunks (and a cross-model import into the prompt) never need more.
- Prefill is chunked: each step the prefilling requests (oldest first) share what the decode batch
  leaves of `max_step_tokens`. Prefill runs for any leased model, lane owner or not.
- Exactly one model owns the decode lane per step (`LanePolicy`); every one of its requests that
  has its first token decodes in that step, with one slot reserved for its token and, for a model
  that speculates, `lookahead` more for a verify pass (unused ones are freed when the step's
  result is committed: the rejected drafts' rollback).
- When the pool cannot hold a decode step even after evicting cached prefixes, the lookahead goes
  first; then the model's newest running request is preempted (recompute): its KV, valid as far as
  it was written, enters the prefix cache and is let go; it waits again, keeping its place by
  arrival, and prefills its prompt plus what it generated.
- A model whose lease is refused for room (`model_blocked`) is retried after a lease is given back
  since its acquire was asked (the engine may start a load before the same plan's releases land,
  so a refusal then is retried at once). It fails only when no other model holds or is taking a
  lease and none was given back since. While it is blocked, and until it is leased (retries
  included), requests that arrived after its oldest waiting request are neither admitted nor
  acquired for other models, so those drain and give their leases back: a blocked model waits at
  most for the requests that arrived before it. Leases are given back when a model has nothing
  running and nothing admissible waiting. A failed load counts as a lease given back (blocked
  models retry rather than wait for it).
- Every request leaves through `abort` (its KV let go uncached), `failed` in a result (the same)
  or `finish` (a completed request: its KV enters the prefix cache); none is lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from polylane.policy.kv.manager import KVManager
from polylane.policy.kv.sequence_blocks import BlockCopy
from polylane.policy.scheduling.lane import LaneCandidate, LaneOwner, LanePolicy
from polylane.types import BlockTable, PrefillWork, StepPlan, StepResult

WAITING, PREFILL, DECODE = "waiting", "prefill", "decode"
IDLE, ACQUIRING, READY, BLOCKED = "idle", "acquiring", "ready", "blocked"


@dataclass(frozen=True)
class SchedulerConfig:
    max_step_tokens: int = 512  # prefill + decode tokens in one step
    max_running: int = 64  # requests of one model admitted at once
    lane_policy: str = "throughput"
    quantum: int = 4  # throughput policy: steps the owner keeps the lane
    aging_steps: int = 8  # priority policy: steps per priority level of aging

    def __post_init__(self) -> None:
        if self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")


@dataclass
class _Request:
    id: int
    model: str
    token_ids: list[int]  # the prompt, then every token generated
    prompt_len: int
    priority: int
    target: int  # tokens to prefill: the prompt, plus what was generated before a preemption
    state: str = WAITING
    computed: int = 0  # tokens of KV held
    ready_step: int = 0  # the step its last token came (or it arrived)
    preemptions: int = 0

    @property
    def generated(self) -> int:
        return len(self.token_ids) - self.prompt_len


@dataclass
class _Model:
    name: str
    order: int
    state: str = IDLE
    kv: KVManager | None = None  # set while leased
    lookahead: int = 0  # slots a decode step reserves past its token (speculation's verify pass)
    acquire_epoch: int = -1  # the release epoch when its lease was last asked for
    gated: bool = False  # refused for room and not leased since: the admission gate holds
    lane_steps: int = 0


@dataclass
class SchedulerCounters:
    steps: int = 0
    decode_steps: int = 0
    switches: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    lane_steps: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self.lane = LanePolicy(
            self.config.lane_policy, quantum=self.config.quantum, aging_steps=self.config.aging_steps
        )
        self._models: dict[str, _Model] = {}
        self._requests: dict[int, _Request] = {}  # unfinished, in arrival (id) order
        self._closing: list[tuple[int, str, str]] = []
        self._step = 0
        self._owner = LaneOwner()
        self._release_epoch = 0
        self.counters = SchedulerCounters()
        # this step's block copies, admissions and preemptions, for the plan
        self._copies: dict[int, list[BlockCopy]] = {}
        self._admitted: set[int] = set()
        self._preempted: list[int] = []

    # ------------------------------------------------------------------ inputs

    def register_model(self, name: str) -> None:
        if name not in self._models:
            self._models[name] = _Model(name, len(self._models))

    def add(self, request_id: int, model: str, prompt_ids: Sequence[int], priority: int = 0) -> None:
        """A new request; ids must increase with arrival."""
        if model not in self._models:
            raise ValueError(f"unknown model {model!r}")
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        if self._requests and request_id <= max(self._requests):
            raise ValueError(f"request ids must increase with arrival, got {request_id}")
        self._requests[request_id] = _Request(
            request_id,
            model,
            list(prompt_ids),
            len(prompt_ids),
            priority,
            target=len(prompt_ids),
            ready_step=self._step,
        )

    def abort(
        self, request_id: int, reason: str = "abort", message: str = "", unstarted_only: bool = False
    ) -> bool:
        """End a request at the next step (its KV let go, never cached); False if already gone, or
        (`unstarted_only`) if it has begun: any of its prompt computed, or a token given."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        if unstarted_only and (request.generated or request.computed):
            return False
        self._drop(request, cache=False)
        self._closing.append((request_id, reason, message))
        return True

    def finish(self, request_id: int) -> None:
        """A request completed (EOS, a stop string, max_tokens; the engine's output check): its
        written KV enters the prefix cache, and it is gone."""
        request = self._requests.get(request_id)
        if request is not None:
            self._drop(request, cache=True)

    def model_ready(self, name: str, kv: KVManager, lookahead: int = 0) -> None:
        """The model is leased: its KV blocks are `kv`'s; a decode step of it reserves `lookahead`
        slots past its token (its speculator's largest verify pass, 0 without one)."""
        model = self._models[name]
        model.state, model.kv, model.gated = READY, kv, False
        self.set_lookahead(name, lookahead)

    def set_lookahead(self, name: str, slots: int) -> None:
        if slots < 0:
            raise ValueError(f"lookahead must be >= 0, got {slots}")
        self._models[name].lookahead = slots

    def model_blocked(self, name: str, message: str) -> None:
        """The lease was refused for room. If no other lease can be given back, that is final."""
        model = self._models[name]
        holders = [m for m in self._models.values() if m.state in (READY, ACQUIRING) and m is not model]
        released_since = self._release_epoch > model.acquire_epoch
        if not holders and not released_since:
            self.model_failed(name, message)
            return
        model.state, model.gated = BLOCKED, True

    def model_failed(self, name: str, message: str) -> None:
        """Loading failed: every request waiting for the model ends with an error."""
        model = self._models[name]
        if model.state == ACQUIRING:  # it took no room after all: blocked models may retry
            self._release_epoch += 1
        model.state, model.gated = IDLE, False
        for request in list(self._requests.values()):
            if request.model == name and request.state == WAITING:
                self.abort(request.id, "error", message)

    # ------------------------------------------------------------------ the plan

    def schedule(self) -> StepPlan:
        self._step += 1
        self._preempted = []
        acquire = self._acquisitions()
        decode_model, decode = self._decode_batch()
        decode = self._reserve_decode(decode)
        self._admit()
        prefill = self._prefill_chunks(self.config.max_step_tokens - len(decode))
        release = self._releases()
        close, self._closing = tuple(self._closing), []
        ids = [w.request_id for w in prefill] + decode
        tables = tuple(self._table(self._requests[i]) for i in ids)
        return StepPlan(
            self._step,
            tuple(prefill),
            decode_model if decode else None,
            tuple(decode),
            tables,
            tuple(self._preempted),
            close,
            acquire,
            release,
        )

    def update(self, plan: StepPlan, result: StepResult) -> None:
        self.counters.steps += 1
        if plan.decode_model is not None and plan.decode:
            self._count_lane(plan.decode_model, len(plan.decode))
        for request_id, computed in result.computed.items():
            if (request := self._requests.get(request_id)) is None or request_id in result.failed:
                continue
            prefilling = request.state == PREFILL
            if prefilling:
                self.counters.prefill_tokens += max(0, computed - request.computed)
            # a prompt keeps its blocks until it is written; a decode step's unused slots go back
            keep = request.target if prefilling and computed < request.target else computed
            self._kv(request).commit(request_id, computed, keep)
            request.computed = computed
        for request_id, first in result.tokens.items():
            if (request := self._requests.get(request_id)) is not None and request_id not in result.failed:
                request.token_ids += (first, *result.extra_tokens.get(request_id, ()))
                request.ready_step = plan.step
                request.state = DECODE
        for request_id in result.failed:
            if (request := self._requests.get(request_id)) is not None:
                self._drop(request, cache=False)

    # ------------------------------------------------------------------ views

    @property
    def step(self) -> int:
        return self._step

    @property
    def lane_owner(self) -> str | None:
        return self._owner.model

    def model_state(self, name: str) -> str:
        return self._models[name].state

    def request_state(self, request_id: int) -> str | None:
        request = self._requests.get(request_id)
        return request.state if request is not None else None

    def num_unfinished(self, model: str | None = None) -> int:
        return sum(1 for r in self._requests.values() if model is None or r.model == model)

    def has_pending_events(self) -> bool:
        return bool(self._closing)

    # ------------------------------------------------------------------ internals

    def _acquisitions(self) -> tuple[str, ...]:
        gate = self._admission_gate()
        wanted = {
            r.model for r in self._requests.values() if r.state == WAITING and (gate is None or r.id <= gate)
        }
        acquire = []
        for model in self._models.values():
            if model.state == BLOCKED and model.name not in wanted:  # its requests all left
                model.state, model.gated = IDLE, False
                continue
            retry = model.state == BLOCKED and model.acquire_epoch < self._release_epoch
            if model.name in wanted and (model.state == IDLE or retry):
                model.state, model.acquire_epoch = ACQUIRING, self._release_epoch
                acquire.append(model.name)
        return tuple(acquire)

    def _decode_batch(self) -> tuple[str | None, list[int]]:
        ready: dict[str, list[_Request]] = {}
        for request in self._requests.values():
            if request.state == DECODE and self._models[request.model].state == READY:
                ready.setdefault(request.model, []).append(request)
        if not ready:
            return None, []
        candidates = [
            LaneCandidate(
                model=name,
                order=self._models[name].order,
                oldest_ready_step=min(r.ready_step for r in requests),
                priority=max(r.priority for r in requests),
            )
            for name, requests in ready.items()
        ]
        owner = self.lane.choose(candidates, self._owner, self._step)
        return owner, [r.id for r in ready[owner]]

    def _admission_gate(self) -> int | None:
        """Requests with a higher id wait while a model is blocked for room (see the rules)."""
        blocked = {m.name for m in self._models.values() if m.gated}
        waiting = [r.id for r in self._requests.values() if r.state == WAITING and r.model in blocked]
        return min(waiting) if waiting else None

    def _reserve_decode(self, batch: list[int]) -> list[int]:
        """Slots for the decode batch's tokens (and lookahead), preempting where the pool is short;
        the requests that decode."""
        if not batch:
            return batch
        model = self._models[self._requests[batch[0]].model]
        kv, lookahead = self._kv(self._requests[batch[0]]), model.lookahead
        reserved: list[int] = []
        for request_id in batch:
            while self._requests[request_id].state == DECODE:
                copies = kv.reserve(request_id, 1 + lookahead)
                if copies is not None:
                    self._copies.setdefault(request_id, []).extend(copies)
                    reserved.append(request_id)
                    break
                if lookahead:  # drafts go before anyone is preempted
                    lookahead = 0
                    for other in reserved:
                        kv.commit(other, kv.num_tokens(other), kv.num_tokens(other) + 1)
                    continue
                running = [r for r in self._requests.values() if r.model == model.name and r.state != WAITING]
                self._preempt(max(running, key=lambda r: r.id))
        return [i for i in reserved if self._requests[i].state == DECODE]

    def _preempt(self, request: _Request) -> None:
        self._kv(request).close(request.id, request.token_ids)  # written KV stays cached
        self._copies.pop(request.id, None)
        self._admitted.discard(request.id)
        request.state, request.computed = WAITING, 0
        request.target = len(request.token_ids)
        request.preemptions += 1
        self.counters.preemptions += 1
        self._preempted.append(request.id)

    def _admit(self) -> None:
        gate = self._admission_gate()
        running: dict[str, int] = {}
        for request in self._requests.values():
            if request.state != WAITING:
                running[request.model] = running.get(request.model, 0) + 1
        full: set[str] = set()
        for request in self._requests.values():
            model = self._models[request.model]
            if request.state != WAITING or model.state != READY or model.name in full:
                continue
            if gate is not None and request.id > gate:
                continue
            count, kv = running.get(model.name, 0), self._kv(request)
            copies = None
            if count < self.config.max_running:
                # one block of headroom per running request, and this one's if its first decode
                # token opens a block
                first = kv.blocks_for(request.target + 1) - kv.blocks_for(request.target)
                copies = kv.admit(request.id, request.token_ids[: request.target], count + first)
            if copies is None:
                full.add(model.name)  # first come, first served within a model
                continue
            request.state, request.computed = PREFILL, kv.num_tokens(request.id)
            self._copies[request.id] = copies
            self._admitted.add(request.id)
            running[model.name] = count + 1

    def _table(self, request: _Request) -> BlockTable:
        """The request's table for this plan, with the copies and the hit not yet handed over (an
        admission whose prefill chunk waits for a later step hands them over with that chunk)."""
        kv = self._kv(request)
        admitted = request.id in self._admitted
        self._admitted.discard(request.id)
        return BlockTable(
            request.id,
            kv.table(request.id),
            kv.num_tokens(request.id),
            tuple(self._copies.pop(request.id, ())),
            kv.num_tokens(request.id) if admitted else None,
        )

    def _drop(self, request: _Request, *, cache: bool) -> None:
        """The request is gone; its KV (if it holds any) is let go, cached with `cache`."""
        del self._requests[request.id]
        self._copies.pop(request.id, None)
        self._admitted.discard(request.id)
        kv = self._models[request.model].kv
        if kv is not None and kv.holds(request.id):
            kv.close(request.id, request.token_ids if cache else None)

    def _kv(self, request: _Request) -> KVManager:
        kv = self._models[request.model].kv
        assert kv is not None, f"model {request.model!r} holds no lease"
        return kv

    def _prefill_chunks(self, budget: int) -> list[PrefillWork]:
        chunks = []
        for request in self._requests.values():
            if budget <= 0:
                break
            if request.state != PREFILL:
                continue
            size = min(budget, max(1, request.target - request.computed))
            chunks.append(PrefillWork(request.id, request.model, size))
            budget -= size
        return chunks

    def _releases(self) -> tuple[str, ...]:
        someone_blocked = self._admission_gate() is not None
        busy = {r.model for r in self._requests.values() if r.state != WAITING}
        waiting = {r.model for r in self._requests.values() if r.state == WAITING}
        release = []
        for model in self._models.values():
            if model.state != READY or model.name in busy:
                continue
            if model.name not in waiting or someone_blocked:
                model.state = IDLE
                release.append(model.name)
        if release:
            self._release_epoch += 1
        return tuple(release)

    def _count_lane(self, name: str, batch: int) -> None:
        counters = self.counters
        counters.decode_steps += 1
        counters.decode_tokens += batch
        counters.lane_steps[name] = counters.lane_steps.get(name, 0) + 1
        if self._owner.model == name:
            self._owner = LaneOwner(name, self._owner.order, self._owner.held + 1)
        else:
            if self._owner.model is not None:
                counters.switches += 1
            self._owner = LaneOwner(name, self._models[name].order, 1)
