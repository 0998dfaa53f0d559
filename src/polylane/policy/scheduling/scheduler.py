"""The online scheduler: which requests run, which models are leased, who owns the decode lane.

What this module owns: every unfinished request's place in its life (waiting → prefill → decode →
gone), each model's lease state, KV admission by block counts, chunked prefill under a per-step
token budget, and the lane choice. It turns that into one `StepPlan` per step and reads back one
`StepResult`. Pure policy: no torch, no threads, no clocks (steps are the clock).

Rules:
- A request waits until its model holds a lease (the plan asks the engine to `acquire` it) and its
  model's pool has blocks for its whole prompt plus one (counted without prefix-cache hits, so
  admission never over-commits), and its model runs fewer than `max_running` requests.
- Prefill is chunked: each step the prefilling requests (oldest first) share what the decode batch
  leaves of `max_step_tokens`. Prefill runs for any leased model, lane owner or not.
- Exactly one model owns the decode lane per step (`LanePolicy`); every one of its requests that
  has its first token decodes in that step.
- Admission counts what is already promised: each running request keeps one block of headroom,
  and a request still prefilling also keeps the blocks its prompt has yet to fill (`free_blocks`
  only shows what the runner has taken so far).
- A model whose lease is refused for room (`model_blocked`) is retried after a lease is given back
  since its acquire was asked (the engine may start a load before the same plan's releases land,
  so a refusal then is retried at once). It fails only when no other model holds or is taking a
  lease and none was given back since. While it is blocked, and until it is leased (retries
  included), requests that arrived after its oldest waiting request are neither admitted nor
  acquired for other models, so those drain and give their leases back: a blocked model waits at
  most for the requests that arrived before it. Leases are given back when a model has nothing
  running and nothing admissible waiting. A failed load counts as a lease given back (blocked
  models retry rather than wait for it).
- Preemption is by recompute: a request whose KV the runner dropped for want of blocks goes back
  to waiting (keeping its place by arrival) and prefills its prompt plus what it generated.
- Every request leaves through `close` (abort, error), `failed` or `finished`; none is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from polylane.policy.scheduling.lane import LaneCandidate, LaneOwner, LanePolicy
from polylane.types import PrefillWork, StepPlan, StepResult

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
    prompt_len: int
    priority: int
    target: int  # tokens to prefill: the prompt, plus what was generated before a preemption
    state: str = WAITING
    computed: int = 0  # tokens of KV held
    generated: int = 0
    ready_step: int = 0  # the step its last token came (or it arrived)
    preemptions: int = 0


@dataclass
class _Model:
    name: str
    order: int
    state: str = IDLE
    free_blocks: int = 0
    block_size: int = 16
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

    # ------------------------------------------------------------------ inputs

    def register_model(self, name: str) -> None:
        if name not in self._models:
            self._models[name] = _Model(name, len(self._models))

    def add(self, request_id: int, model: str, prompt_len: int, priority: int = 0) -> None:
        """A new request; ids must increase with arrival."""
        if model not in self._models:
            raise ValueError(f"unknown model {model!r}")
        if prompt_len < 1:
            raise ValueError("a prompt needs at least one token")
        if self._requests and request_id <= max(self._requests):
            raise ValueError(f"request ids must increase with arrival, got {request_id}")
        self._requests[request_id] = _Request(
            request_id, model, prompt_len, priority, target=prompt_len, ready_step=self._step
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
        del self._requests[request_id]
        self._closing.append((request_id, reason, message))
        return True

    def model_ready(self, name: str, free_blocks: int, block_size: int) -> None:
        model = self._models[name]
        model.state, model.free_blocks, model.block_size = READY, free_blocks, block_size
        model.gated = False

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
        acquire = self._acquisitions()
        decode_model, decode = self._decode_batch()
        self._admit()
        prefill = self._prefill_chunks(self.config.max_step_tokens - len(decode))
        release = self._releases()
        close, self._closing = tuple(self._closing), []
        return StepPlan(self._step, tuple(prefill), decode_model, tuple(decode), close, acquire, release)

    def update(self, plan: StepPlan, result: StepResult) -> None:
        self.counters.steps += 1
        if plan.decode_model is not None and plan.decode:
            self._count_lane(plan.decode_model, len(plan.decode))
        for request_id, computed in result.computed.items():
            if (request := self._requests.get(request_id)) is not None:
                if request.state == PREFILL:
                    fresh = computed - request.computed - result.cached.get(request_id, 0)
                    self.counters.prefill_tokens += max(0, fresh)
                request.computed = computed
        for request_id in result.tokens:
            if (request := self._requests.get(request_id)) is not None:
                request.generated += 1 + len(result.extra_tokens.get(request_id, ()))
                request.ready_step = plan.step
                request.state = DECODE
        for request_id in result.preempted:
            if (request := self._requests.get(request_id)) is not None:
                request.state, request.computed = WAITING, 0
                request.target = request.prompt_len + request.generated
                request.preemptions += 1
                self.counters.preemptions += 1
        for request_id in (*result.failed, *result.finished):
            self._requests.pop(request_id, None)
        for name, free in result.free_blocks.items():
            if name in self._models:
                self._models[name].free_blocks = free

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

    def _admit(self) -> None:
        gate = self._admission_gate()
        running: dict[str, int] = {}
        promised: dict[str, int] = {}
        for request in self._requests.values():
            if request.state != WAITING:
                running[request.model] = running.get(request.model, 0) + 1
                # One block of headroom per running request (a decode step may open a new block),
                # and the blocks a prefilling request's prompt has yet to take.
                size = self._models[request.model].block_size
                unfilled = 0
                if request.state == PREFILL:
                    unfilled = max(0, _blocks(request.target + 1, size) - _blocks(request.computed, size))
                promised[request.model] = promised.get(request.model, 0) + unfilled + 1
        available = {m.name: m.free_blocks - promised.get(m.name, 0) for m in self._models.values()}
        full: set[str] = set()
        for request in self._requests.values():
            model = self._models[request.model]
            if request.state != WAITING or model.state != READY or model.name in full:
                continue
            if gate is not None and request.id > gate:
                continue
            needed = _blocks(request.target + 1, model.block_size)
            if running.get(model.name, 0) >= self.config.max_running or available[model.name] < needed:
                full.add(model.name)  # first come, first served within a model
                continue
            request.state = PREFILL
            available[model.name] -= needed + 1
            running[model.name] = running.get(model.name, 0) + 1

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


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)
