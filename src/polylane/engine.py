"""The engine: many models, one decode lane, requests streamed as they decode.

What this module owns: the request lifecycle (submit → stream → finish), the engine thread and its
loop, model registration (tokenizer and context length known before any weights load), loading
models in the background through the `ResidencyManager`, and turning sampled tokens into text
(EOS, stop strings, max_tokens). The decisions are the `Scheduler`'s, the tensors the `Runner`'s:

    plan = scheduler.schedule(); result = runner.execute(plan); scheduler.update(plan, result);
    deliver(plan, result)  # a completed request: scheduler.finish (its KV enters the prefix cache)

Everything else reaches the loop through a thread-safe inbox (submits, aborts, finished loads), so
the engine thread alone touches the scheduler, the runner and the models' KV. Each request gets a
`RequestHandle` to iterate (sync or async) and to abort.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from polylane.engine_stats import EngineStats, StatsRecorder
from polylane.policy.residency.eviction import DEFAULT_EVICTION
from polylane.policy.residency.pool import NoRoomError, ResidencyError, UnknownModelError
from polylane.policy.scheduling.scheduler import Scheduler, SchedulerConfig
from polylane.policy.scheduling.stop_strings import StopStringMatcher
from polylane.policy.speculation.control import SpeculationConfig
from polylane.runtime.cpu_load import ComputeThreads
from polylane.runtime.loading.load_thread import TransientWorker
from polylane.runtime.loading.model_record import DEFAULT_KV_TOKENS, ModelRecord, resolve_record
from polylane.runtime.residency.manager import ModelLease, ResidencyManager
from polylane.runtime.runner import Runner
from polylane.runtime.sampling.detokenizer import IncrementalDetokenizer
from polylane.runtime.sampling.grammar import Constraint
from polylane.runtime.sampling.tokenizer import ChatTemplateError
from polylane.runtime.speculation.setup import SpeculationSetup
from polylane.types import DEFAULT_DTYPE, SamplingParams, StepPlan, StepResult, TokenLogprob

log = logging.getLogger(__name__)


class RequestTooLongError(ValueError):
    """The prompt plus max_tokens do not fit the model's context (or its KV pool)."""


# Woken from idle, the loop gathers a burst (`EngineConfig.arrival_quiet_s`), polling this often,
# for at most this long.
ARRIVAL_POLL_S = 0.0002
ARRIVAL_WAIT_S = 0.02


class EngineDeadError(RuntimeError):
    """The engine loop stopped (closed, or an internal error); no request can be served."""


@dataclass(frozen=True)
class EngineConfig:
    budget_bytes: int
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    block_size: int = 16
    eviction: str = DEFAULT_EVICTION  # which idle model leaves first under the budget (policy/residency)
    quiet: bool = True  # no progress bars while loading
    device: str = "auto"  # where every model runs: auto (CUDA when torch sees a GPU), cpu, cuda[:N]
    # Woken from idle, the first step waits until no request has arrived for this long (and no
    # submit is still tokenising), at most ARRIVAL_WAIT_S: a burst of clients then prefills in one
    # step rather than as a first request and then the rest (0: start at once).
    arrival_quiet_s: float = 0.002
    # Compute threads (torch's and the native stack's): 0 adapts to the machine, every core while it
    # is idle and fewer while other processes keep cores busy (`policy/scheduling/threads.py`); N fixes N.
    threads: int = 0


@dataclass(frozen=True)
class StreamEvent:
    """A piece of one request's output: new text and tokens; the last event has `finish_reason`."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of token_ids, when the request asked


@dataclass
class Completion:
    """A finished request, as `RequestHandle.result()` returns it."""

    request_id: int
    model: str
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort | error
    error: str | None
    prompt_tokens: int
    cached_tokens: int
    ttft_seconds: float | None
    tpot_seconds: float | None  # mean seconds per output token after the first
    queue_seconds: float | None = None  # from submission to its first prefill step (None: never began)
    e2e_seconds: float | None = None  # from submission to its last event
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked


class RequestHandle:
    """One submitted request: iterate it (or `async for`) for `StreamEvent`s, or call `result()`."""

    def __init__(self, engine: Engine, request_id: int, model: str, prompt_ids: list[int]) -> None:
        self.id = request_id
        self.model = model
        self.prompt_ids = prompt_ids
        self._engine = engine
        self._events: list[StreamEvent] = []
        self._done = threading.Event()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.cached_tokens = 0
        self.submitted_at = time.perf_counter()
        self.started_at: float | None = None  # its first prefill step began (the queue is behind it)
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def abort(self, reason: str = "abort") -> None:
        """Stop this request at the next step; its KV is freed and never cached."""
        self._engine.abort(self.id, reason)

    def abort_if_waiting(self, reason: str) -> None:
        """Stop this request only if it has not begun (still queued: no prefill, no token)."""
        self._engine.abort(self.id, reason, unstarted_only=True)

    def __iter__(self) -> Iterator[StreamEvent]:
        index = 0
        while True:
            with self._cond:
                while index >= len(self._events):
                    self._cond.wait()
                event = self._events[index]
            index += 1
            yield event
            if event.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        with self._cond:
            self._waiters.append((loop, wake))
        try:
            index = 0
            while True:
                with self._cond:
                    pending = self._events[index:]
                index += len(pending)
                for event in pending:
                    yield event
                    if event.finish_reason is not None:
                        return
                await wake.wait()
                wake.clear()
        finally:
            with self._cond:
                self._waiters.remove((loop, wake))

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        text = "".join(e.text for e in self._events)
        tokens = [t for e in self._events for t in e.token_ids]
        last = self._events[-1]
        ttft = self.first_token_at - self.submitted_at if self.first_token_at is not None else None
        tpot = None
        if self.first_token_at is not None and self.last_token_at is not None and len(tokens) > 1:
            tpot = (self.last_token_at - self.first_token_at) / (len(tokens) - 1)
        return Completion(
            self.id,
            self.model,
            text,
            tokens,
            last.finish_reason or "error",
            last.error,
            len(self.prompt_ids),
            self.cached_tokens,
            ttft,
            tpot,
            self.started_at - self.submitted_at if self.started_at is not None else None,
            self.finished_at - self.submitted_at if self.finished_at is not None else None,
            [entry for e in self._events for entry in e.logprobs],
        )

    def _push(self, event: StreamEvent, wakes: _Wakes) -> None:
        """Add an event and wake the readers: threads now; asyncio readers are collected in `wakes`
        per event loop, for one `_wake_loops` call once the step's events are all out."""
        with self._cond:
            self._events.append(event)
            if event.finish_reason is not None:
                self.finished_at = time.perf_counter()
                self._done.set()  # before any waiter wakes: result(timeout=0) then sees it done
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, wake in waiters:
            wakes.setdefault(loop, []).append(wake)


# asyncio readers to wake, by their event loop: one thread-safe call per loop and step
_Wakes = dict[asyncio.AbstractEventLoop, list[asyncio.Event]]


def _wake_loops(wakes: _Wakes) -> None:
    for loop, events in wakes.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # that loop is closed: nobody is left on it to wake
            continue


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


@dataclass
class _Output:
    """The engine thread's per-request text state."""

    handle: RequestHandle
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    stop_ids: frozenset[int]
    generated: int = 0


class Engine:
    def __init__(self, config: EngineConfig, manager: ResidencyManager | None = None) -> None:
        self.config = config
        self.manager = manager or ResidencyManager(
            config.budget_bytes,
            eviction=config.eviction,
            block_size=config.block_size,
            quiet=config.quiet,
            device=config.device,
        )
        self.scheduler = Scheduler(config.scheduler)
        self.runner = Runner()
        self.speculation = SpeculationSetup(self.manager, self.runner)
        self.stats_recorder = StatsRecorder()
        self.compute_threads = ComputeThreads(config.threads)
        self._models: dict[str, ModelRecord] = {}
        self._outputs: dict[int, _Output] = {}
        self._last_active: dict[str, float] = {}  # model → monotonic time its last request began or ended
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ids = itertools.count(1)
        self._submit_lock = threading.Lock()
        self._arriving = 0  # `submit` calls under way (rendering, tokenising) in other threads
        self._arriving_lock = threading.Lock()
        self._loader = TransientWorker("polylane-load")  # lives only while it loads (see its module)
        self._stopping = False
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="polylane-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ models

    def add_model(
        self,
        name: str,
        source: str | None = None,
        *,
        dtype: str = DEFAULT_DTYPE,
        pinned: bool = False,
        kv_tokens: int = DEFAULT_KV_TOKENS,
        speculation: SpeculationConfig | bool | str | list[str] | dict[str, Any] | None = None,
    ) -> ModelRecord:
        """Serve a model (catalogue name or local path; fetched now if missing, loaded on first use).

        speculation: speculative decoding for this model's requests (a `SpeculationConfig`, True
        for the defaults, drafter names, or a dict of its fields; see `policy.speculation.control`).
        """
        if name in self._models:
            raise ValueError(f"model {name!r} is already registered")
        if not isinstance(speculation, SpeculationConfig):
            speculation = SpeculationConfig.parse(speculation)
        record = resolve_record(
            name,
            source,
            dtype=dtype,
            kv_tokens=kv_tokens,
            pinned=pinned,
            speculation=speculation,
            quiet=self.config.quiet,
        )
        self.manager.register(record)
        self.runner.sharing.declare(name, record.digest)  # peers may share its layers
        self.speculation.register(record)
        self._models[name] = record
        self._inbox.put(("model", name))
        self._wake.set()
        return record

    @property
    def models(self) -> dict[str, ModelRecord]:
        return dict(self._models)

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        model: str,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> RequestHandle:
        """Queue a request (a prompt string, token ids, or chat messages); returns its handle.

        Raises before anything is queued: UnknownModelError, ChatTemplateError (no template),
        ValueError (empty prompt, token ids out of range), RequestTooLongError (with both counts).
        """
        if self.error is not None or self._stopping:
            raise EngineDeadError(self.error or "the engine is closed")
        served = self._models.get(model)
        if served is None:
            raise UnknownModelError(model, list(self._models))
        params = params or SamplingParams()
        with self._arriving_lock:
            self._arriving += 1
        try:
            return self._queue(model, served, prompt, messages, params, priority)
        finally:
            with self._arriving_lock:
                self._arriving -= 1

    def _queue(
        self,
        model: str,
        served: ModelRecord,
        prompt: str | Sequence[int] | None,
        messages: list[dict[str, str]] | None,
        params: SamplingParams,
        priority: int,
    ) -> RequestHandle:
        prompt_ids = self.prompt_ids(model, prompt, messages)
        vocabulary = served.tokenizer.vocab_size
        if any(token >= vocabulary for token, _ in params.logit_bias):
            token = next(t for t, _ in params.logit_bias if t >= vocabulary)
            raise ValueError(
                f"logit_bias: token id {token} is out of range for {model!r} (vocabulary of {vocabulary})"
            )
        needed = len(prompt_ids) + params.max_tokens
        if needed > served.max_context:
            raise RequestTooLongError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {needed} "
                f"tokens exceeds the context length of {model!r} ({served.max_context} tokens)"
            )
        if needed > served.kv_tokens:
            raise RequestTooLongError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {needed} "
                f"tokens exceeds the KV cache of {model!r} ({served.kv_tokens} tokens)"
            )
        # compiled here, in the caller's thread: the first grammar of a model builds its vocabulary's
        # index (a few hundred ms), which the engine loop must not wait on
        constraint = Constraint(params.grammar, served.tokenizer) if params.grammar is not None else None
        with self._submit_lock:
            handle = RequestHandle(self, next(self._ids), model, prompt_ids)
            self._inbox.put(("submit", (handle, params, priority, constraint)))
        self._wake.set()
        return handle

    def generate(
        self, model: str, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> Completion:
        return self.submit(model, prompt, params=params).result()

    def abort(self, request_id: int, reason: str = "abort", unstarted_only: bool = False) -> None:
        """End a request at the next step with `reason` ("abort", "deadline", "queue_timeout",
        "shutdown"); KV freed, not cached. `unstarted_only`: only if it has not begun."""
        self._inbox.put(("abort", (request_id, reason, "", unstarted_only)))
        self._wake.set()

    def requests_in_flight(self) -> dict[str, int]:
        """Per model, its requests accepted and not yet ended (any thread may ask)."""
        counts: dict[str, int] = {}
        for output in list(self._outputs.values()):  # a copy: the loop adds and removes meanwhile
            counts[output.handle.model] = counts.get(output.handle.model, 0) + 1
        return counts

    def requests_waiting(self) -> dict[str, int]:
        """Per model, its requests accepted and not yet begun (no prefill step yet)."""
        counts: dict[str, int] = {}
        for output in list(self._outputs.values()):
            if output.handle.started_at is None:
                counts[output.handle.model] = counts.get(output.handle.model, 0) + 1
        return counts

    def idle_seconds(self) -> dict[str, float]:
        """Per model that has served a request, seconds since its last one began or ended (0 while
        one runs)."""
        busy, now = self.requests_in_flight(), time.monotonic()
        return {name: 0.0 if busy.get(name) else now - at for name, at in list(self._last_active.items())}

    def stats(self) -> EngineStats:
        return self.stats_recorder.snapshot(
            self.scheduler.counters,
            self.runner.monitor,
            self.manager.counters(),
            self._prefix_stats(),
            self.runner.sharing.stats(),
            speculation=self.speculation.snapshot(),
        )

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def close(self) -> None:
        """Stop the loop; unfinished requests end with `abort`; models are unloaded."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self._loader.shutdown()
        self.manager.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            while not self._stopping:
                if (self._inbox.qsize() or self._arriving) and not self.scheduler.num_unfinished():
                    # work comes to an engine that has none (woken from idle, or arriving as the
                    # last request finished): the burst it belongs to joins one first step
                    self._let_submissions_land()
                self._drain_inbox()
                plan = self.scheduler.schedule()
                if plan.is_idle:
                    # sampled while idle too, so that the count is right when work comes
                    self.compute_threads.step()
                    self._wake.wait(timeout=self.compute_threads.policy.interval_s)
                    self._wake.clear()
                    continue
                self._start_loads(plan.acquire)
                started = time.perf_counter()
                self._mark_started(plan, started)
                result = self.runner.execute(plan)
                self.scheduler.update(plan, result)
                self._deliver(plan, result)
                self.stats_recorder.step(plan, result, time.perf_counter() - started)
                self.compute_threads.step()
        except Exception as error:  # a bug in the loop: fail every request loudly, never hang
            log.exception("engine loop failed")
            self.error = f"engine loop failed: {type(error).__name__}: {error}"
        finally:
            self._shutdown()

    def _let_submissions_land(self) -> None:
        """Work comes to an idle engine: let requests that other threads are submitting at this
        moment (a burst of clients) join the first step's prefill instead of waiting a whole
        prefill step for the next: hand the GIL over while the inbox still grows, then wait until
        no request has arrived for `arrival_quiet_s` and no `submit` is still rendering or
        tokenising its prompt, at most ARRIVAL_WAIT_S. A lone request waits `arrival_quiet_s` (2 ms)."""
        seen = -1
        for _ in range(16):
            if self._inbox.qsize() == seen:
                break
            seen = self._inbox.qsize()
            time.sleep(0)  # releases the GIL: a submitting thread waiting for it runs
        quiet = self.config.arrival_quiet_s
        if quiet <= 0 or not (seen or self._arriving):  # (nothing came after all)
            return
        deadline = time.perf_counter() + ARRIVAL_WAIT_S
        quiet_until = time.perf_counter() + quiet
        while time.perf_counter() < deadline:
            size = self._inbox.qsize()
            if size != seen:
                seen, quiet_until = size, time.perf_counter() + quiet
            elif not self._arriving and time.perf_counter() >= quiet_until:
                return
            time.sleep(ARRIVAL_POLL_S)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._accept(*payload)
            elif kind == "abort":
                self.scheduler.abort(*payload)  # the next plan's close ends the stream
            elif kind == "model":
                self.scheduler.register_model(payload)
            elif kind == "loaded":
                self._model_loaded(*payload)

    def _accept(
        self, handle: RequestHandle, params: SamplingParams, priority: int, constraint: Constraint | None
    ) -> None:
        served = self._models[handle.model]
        self._last_active[handle.model] = time.monotonic()
        self._outputs[handle.id] = _Output(
            handle,
            params,
            IncrementalDetokenizer(served.tokenizer),
            StopStringMatcher(params.stop),
            served.tokenizer.stop_token_ids,
        )
        self.runner.add(handle.id, handle.model, handle.prompt_ids, params, constraint)
        self.scheduler.add(handle.id, handle.model, handle.prompt_ids, priority)
        self.stats_recorder.submitted(handle.model)

    def _start_loads(self, names: Sequence[str]) -> None:
        for name in names:
            self._loader.submit(self._load, name)

    def _load(self, name: str) -> None:
        """Loader thread: acquire a lease (loading the model if needed) and tell the loop."""
        drafters: dict[str, ModelLease] = {}
        try:
            lease: ModelLease | Exception = self.manager.acquire(name)
        except Exception as error:  # reported to the loop; the model's requests get the error
            lease = error
        else:
            drafters = self.speculation.acquire_drafters(name)
        self._inbox.put(("loaded", (name, lease, drafters)))
        self._wake.set()

    def _model_loaded(
        self, name: str, lease: ModelLease | Exception, drafters: dict[str, ModelLease] | None = None
    ) -> None:
        if isinstance(lease, NoRoomError):
            self.scheduler.model_blocked(name, str(lease))
        elif isinstance(lease, Exception):
            message = str(lease) if isinstance(lease, ResidencyError | RuntimeError) else repr(lease)
            self.scheduler.model_failed(name, message)
        elif self._stopping:
            lease.release()
            for drafter in (drafters or {}).values():
                drafter.release()
        else:
            self.runner.attach(lease)
            self.speculation.attach(name, lease, drafters or {})
            self.speculation.offer(name)  # idle models draft: targets that may use it take it
            self.scheduler.model_ready(name, lease.kv.manager)
            for target in self.runner.speculators:  # this one, and targets it may now draft for
                self.scheduler.set_lookahead(target, self.speculation.lookahead(target))

    def _deliver(self, plan: StepPlan, result: StepResult) -> None:
        """Hand tokens to their streams; decide EOS / stop string / length; end finished requests."""
        wakes: _Wakes = {}
        for request_id, reason, message in plan.close:
            self._end(request_id, reason, message or None, wakes=wakes)
        for request_id, message in result.failed.items():
            self._end(request_id, "error", message, wakes=wakes)
        now = time.perf_counter()
        for table in plan.tables:
            output = self._outputs.get(table.request_id)
            if table.cached is not None and output is not None and output.generated == 0:
                output.handle.cached_tokens = table.cached
        for request_id, first in result.tokens.items():
            output = self._outputs[request_id]
            handle = output.handle
            if handle.first_token_at is None:
                handle.first_token_at = now
                self.stats_recorder.first_token(handle.model, now - handle.submitted_at)
            handle.last_token_at = now
            reason, text, tokens = None, "", []
            # one token, or the several of a speculative round, each checked in turn
            for token in (first, *result.extra_tokens.get(request_id, ())):
                output.generated += 1
                tokens.append(token)
                if token in output.stop_ids and not output.params.ignore_eos:
                    text += output.stops.push(output.detokenizer.flush())
                    text, reason = text + output.stops.flush(), "stop"
                    break
                text += output.stops.push(output.detokenizer.push(token))
                if output.stops.stopped:
                    reason = "stop"
                    break
                if output.generated >= output.params.max_tokens:
                    text += output.stops.push(output.detokenizer.flush())  # a character cut short: U+FFFD
                    text, reason = text + output.stops.flush(), ("stop" if output.stops.stopped else "length")
                    break
            logprobs = result.logprobs.get(request_id, ())[: len(tokens)]
            if reason is None:
                handle._push(StreamEvent(text, tuple(tokens), logprobs=logprobs), wakes)
                continue
            self.scheduler.finish(request_id)  # its KV enters the prefix cache
            self.runner.finish(request_id, cache=True)
            self._end(request_id, reason, None, wakes, text, tuple(tokens), logprobs)
        _wake_loops(wakes)

    def _end(
        self,
        request_id: int,
        reason: str,
        error: str | None,
        wakes: _Wakes,
        text: str = "",
        tokens: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        output = self._outputs.pop(request_id, None)
        if output is None:
            return
        self.runner.finish(request_id, cache=False)
        handle = output.handle
        self._last_active[handle.model] = time.monotonic()
        self.stats_recorder.finished(handle.model, reason, output.generated, handle)
        handle._push(StreamEvent(text, tokens, reason, error, logprobs), wakes)

    def _shutdown(self) -> None:
        reason = "error" if self.error else "abort"
        message = self.error or "the engine was closed"
        wakes: _Wakes = {}
        while True:  # requests still in the inbox
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                payload[0]._push(StreamEvent("", (), reason, message), wakes)
            elif kind == "loaded" and not isinstance(payload[1], Exception):
                payload[1].release()
                for drafter in payload[2].values():
                    drafter.release()
        for request_id in list(self._outputs):
            self.scheduler.abort(request_id)  # its KV let go
            self._end(request_id, reason, message, wakes)
        _wake_loops(wakes)
        self.runner.detach_all()
        self.compute_threads.restore()

    def _mark_started(self, plan: StepPlan, now: float) -> None:
        """The time each request's first prefill step begins (its queue time ends there)."""
        for work in plan.prefill:
            output = self._outputs.get(work.request_id)
            if output is not None and output.handle.started_at is None:
                output.handle.started_at = now

    def _prefix_stats(self) -> dict[str, Any]:
        out = {}
        for name, lease in list(self.runner.leases.items()):
            stats = lease.kv.stats()
            if stats is not None:
                out[name] = stats
        return out

    def prompt_ids(
        self,
        model: str,
        prompt: str | Sequence[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The token ids a request would run: a prompt string encoded, token ids checked against
        the vocabulary, or chat messages (and the tools they may call) rendered with the model's
        template."""
        served = self._models.get(model)
        if served is None:
            raise UnknownModelError(model, list(self._models))
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        tokenizer = served.tokenizer
        if messages is not None:
            if not tokenizer.has_chat_template:
                raise ChatTemplateError(
                    f"model {served.name!r} has no chat template (a base model): use completions"
                )
            ids = tokenizer.render_chat(messages, tools)
        elif isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]  # type: ignore[union-attr]
            bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
            if bad:
                shown = str(bad[0]) if len(str(bad[0])) <= 24 else f"{str(bad[0])[:20]}…"
                raise ValueError(
                    f"token id {shown} is out of range for {served.name!r} (vocabulary of "
                    f"{tokenizer.vocab_size})"
                )
        if not ids:
            raise ValueError("the prompt is empty (it has no tokens)")
        return ids
