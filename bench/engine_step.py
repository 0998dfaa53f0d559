"""Where one engine step's time goes while B streams decode together, as `polylane bench single`
runs them (in-process engine, one asyncio reader per stream).

Run:  python bench/engine_step.py [--model smollm2-135m-instruct] [--dtype auto] [--batch 8]
      [--max-tokens 32] [--repeats 4]

Each repeat sends --batch chat requests at once (greedy, EOS ignored) and reads their streams
with asyncio, like the bench's batch phase. The engine loop's parts are timed by wrapping them
(the wrappers add ~1 µs a call): `plan` (inbox, scheduler), `execute` (the runner's whole step),
inside it `reserve` (KV blocks), `batch` (`build_forward_batch`), `forward` (the model call) and
inside that `C forward` (the native call alone, where the model runs natively), `sample`, and
`deliver` (detokenise, stop checks, stream events) with `detokenise` inside it. Reported per
decode-only step (every request decoding, no prefill), as medians over the repeats' steps; the
first repeat prefills prompts nobody sent before, later ones hit the prefix cache. Also the
aggregate decode tokens/s of each repeat (Σ (tokens − 1) / (latest last token − earliest first
token), the bench's `aggregate_decode_tokens_per_s`), and how many of the requests the first
prefill step of each repeat took (all of them unless the burst split). Prints a table and, last,
one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from polylane.bench.engine_client import SUBMIT_THREADS, EngineSetup, open_engine
from polylane.engine import Engine, EngineConfig
from polylane.runtime import runner
from polylane.runtime.kv import model_kv
from polylane.runtime.sampling import detokenizer
from polylane.types import DEFAULT_DTYPE, WEIGHT_DTYPES, SamplingParams

PARTS = ["plan", "execute", "reserve", "batch", "forward", "C forward", "sample", "deliver", "detokenise"]


class StepClock:
    """Wall time of each timed part, per engine step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = defaultdict(float)
        self.decode_only = False
        self.first_prefill: list[int] = []  # per repeat: requests in its first prefill step
        self.repeat_started = False

    def wrap(self, owner: Any, name: str, part: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - started

        setattr(owner, name, timed)

    def end_step(self) -> None:
        if self.decode_only:
            self.steps.append(dict(self.current))
        self.current = defaultdict(float)


def instrument(engine: Engine, model: str, clock: StepClock) -> None:
    for owner, name, part in [
        (engine.scheduler, "schedule", "plan"),
        (engine, "_drain_inbox", "plan"),
        (model_kv.ModelKV, "_reserve", "reserve"),
        (model_kv, "build_forward_batch", "batch"),
        (runner.Runner, "_sample", "sample"),
        (engine, "_deliver", "deliver"),
        (detokenizer.IncrementalDetokenizer, "push", "detokenise"),
    ]:
        clock.wrap(owner, name, part)
    execute = runner.Runner.execute

    def timed_execute(self: runner.Runner, plan: Any) -> Any:
        clock.end_step()  # a step runs from one execute to the next
        clock.decode_only = not plan.prefill and bool(plan.decode)
        if plan.prefill and not clock.repeat_started:
            clock.first_prefill.append(len(plan.prefill))
            clock.repeat_started = True
        started = time.perf_counter()
        try:
            return execute(self, plan)
        finally:
            clock.current["execute"] += time.perf_counter() - started

    runner.Runner.execute = timed_execute  # type: ignore[method-assign]
    lease = engine.manager.acquire(model)  # the resident model object every step runs
    try:
        module = lease.model.module
    finally:
        lease.release()
    clock.wrap(module, "forward", "forward")
    if module.native_stack is not None:
        module.native_stack._lib = _TimedLibrary(module.native_stack._lib, clock)


class _TimedLibrary:
    """The native library with `polylane_forward` timed."""

    def __init__(self, library: Any, clock: StepClock) -> None:
        self._library, self._clock = library, clock

    def __getattr__(self, name: str) -> Callable[..., Any]:
        function = getattr(self._library, name)
        if name != "polylane_forward":
            return function

        def timed(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args)
            finally:
                self._clock.current["C forward"] += time.perf_counter() - started

        return timed


async def send_all(
    engine: Engine, submitter: ThreadPoolExecutor, model: str, batch: int, max_tokens: int, repeat: int
) -> list[list[float]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    loop = asyncio.get_running_loop()

    async def one(i: int) -> list[float]:
        question = f"Question {repeat}.{i}: name a river and say where it flows."
        messages = [{"role": "user", "content": question}]
        submit = functools.partial(engine.submit, model, messages=messages, params=params)
        handle = await loop.run_in_executor(submitter, submit)
        times = []
        async for event in handle:
            if event.token_ids:
                times.append(time.perf_counter())
        return times

    return await asyncio.gather(*(one(i) for i in range(batch)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default=DEFAULT_DTYPE, choices=WEIGHT_DTYPES)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument(
        "--arrival-quiet-ms",
        type=float,
        default=EngineConfig.arrival_quiet_s * 1e3,
        help="EngineConfig.arrival_quiet_s in ms (0: the first step starts as soon as a request lands)",
    )
    args = parser.parse_args()
    engine = open_engine(EngineSetup(models=((args.model, args.model),), dtype=args.dtype))
    engine.config = dataclasses.replace(engine.config, arrival_quiet_s=args.arrival_quiet_ms / 1e3)
    clock = StepClock()
    submitter = ThreadPoolExecutor(SUBMIT_THREADS)  # as the bench's EngineClient submits
    try:
        instrument(engine, args.model, clock)
        aggregates = []
        for repeat in range(args.repeats):
            clock.repeat_started = False
            sending = send_all(engine, submitter, args.model, args.batch, args.max_tokens, repeat)
            streams = asyncio.run(sending)
            span = max(s[-1] for s in streams) - min(s[0] for s in streams)
            aggregates.append(sum(len(s) - 1 for s in streams) / span)
            clock.end_step()
    finally:
        submitter.shutdown()
        engine.close()
    steps = clock.steps
    medians = {part: statistics.median(s.get(part, 0.0) for s in steps) * 1e3 for part in PARTS}
    loop = ("plan", "execute", "deliver")
    step_ms = statistics.median(sum(s.get(part, 0.0) for part in loop) for s in steps) * 1e3
    print(f"{args.model} {args.dtype}, {args.batch} streams: {len(steps)} decode-only steps")
    print("| part | ms per step (median) |")
    print("|---|---:|")
    for part in PARTS:
        print(f"| {part} | {medians[part]:.3f} |")
    print(f"| plan + execute + deliver | {step_ms:.3f} |")
    print("aggregate decode tokens/s per repeat: " + ", ".join(f"{a:.0f}" for a in aggregates))
    print("requests in each repeat's first prefill step: " + ", ".join(map(str, clock.first_prefill)))
    print(
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "batch": args.batch,
                "steps": len(steps),
                "ms_per_step": medians,
                "loop_ms_per_step": step_ms,
                "aggregate_decode_tokens_per_s": aggregates,
                "first_prefill_requests": clock.first_prefill,
            }
        )
    )


if __name__ == "__main__":
    main()
