"""A bench system in its own process: `python -m polylane.bench.worker`, driven over stdin/stdout.

What this module owns: the worker side of the protocol the harness (`systems.py`) speaks. Every
local system runs in workers, so systems never share a heap, a thread pool or a prefix cache, and
only one system holds memory at a time.

Protocol: one JSON object per line. The parent sends `{"op": "start", ...setup}`; the worker
loads and warms up, then answers `{"event": "ready", "load_seconds": s}`. For each
`{"op": "run", "phase": {...}}` it answers `{"event": "done"}` once per finished request (progress)
and then `{"event": "result", "timelines": [...], "engine": counters or null}`, the timelines on
the worker's clock from the moment it read the command; a phase of an engine worker still running
after the command's `timeout_s` fails with the stacks of every thread on stderr (a hung engine
never hangs the bench). `{"op": "quit"}` ends it. Any failure is
answered with `{"event": "error", "message": ...}` and a non-zero exit. Whatever else the worker
prints goes to its stderr: the real stdout carries the protocol only.

Setups: `{"kind": "engine", "models": [[name, source], ...], "dtype", "budget_bytes",
"kv_tokens", "lane_policy", "prefix_cache", "threads", "speculation", "device"}` (polylane and its mode
variants, plain, one of the per-process engines; `speculation` is the first model's, as
`Engine.add_model` takes it, or null), `{"kind": "transformers", "models", "dtype", "assisted",
"threads", "device"}` or `{"kind": "llama.cpp", "models", "threads"}`.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import sys
import time
import traceback
from typing import Any, TextIO

from polylane.bench.workloads import Phase


def _answer(stream: TextIO, message: dict[str, Any]) -> None:
    stream.write(json.dumps(message) + "\n")
    stream.flush()


def main() -> int:
    protocol: TextIO = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to stderr
    try:
        _serve(protocol)
    except Exception as error:
        traceback.print_exc(file=sys.stderr)
        _answer(protocol, {"event": "error", "message": f"{type(error).__name__}: {error}"})
        return 1
    return 0


def _serve(protocol: TextIO) -> None:
    setup = json.loads(sys.stdin.readline() or "{}")
    if setup.get("op") != "start":
        raise ValueError(f"expected a start command, got {setup!r}")
    import torch

    if setup.get("threads") and setup["kind"] != "engine":  # an engine sets its own (EngineConfig.threads)
        torch.set_num_threads(int(setup["threads"]))
    models = tuple((name, source) for name, source in setup["models"])
    started = time.perf_counter()
    if setup["kind"] == "engine":
        system: _EngineSystem | _TransformersSystem | _LlamaCppSystem = _EngineSystem(setup, models)
    elif setup["kind"] == "transformers":
        system = _TransformersSystem(setup, models)
    elif setup["kind"] == "llama.cpp":
        system = _LlamaCppSystem(setup, models)
    else:
        raise ValueError(f"unknown worker kind {setup['kind']!r}")
    _answer(protocol, {"event": "ready", "load_seconds": time.perf_counter() - started})
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "quit":
                return
            if command["op"] != "run":
                raise ValueError(f"unknown command {command['op']!r}")
            phase = Phase.from_dict(command["phase"])
            timeout = float(command.get("timeout_s") or 3600)
            timelines, engine = system.run(phase, lambda _: _answer(protocol, {"event": "done"}), timeout)
            _answer(
                protocol,
                {"event": "result", "timelines": [t.to_dict() for t in timelines], "engine": engine},
            )
    finally:
        system.close()


class _EngineSystem:
    def __init__(self, setup: dict[str, Any], models: tuple[tuple[str, str], ...]) -> None:
        from polylane.bench.engine_client import EngineClient, EngineSetup, open_engine

        self.engine = open_engine(
            EngineSetup(
                models,
                dtype=setup["dtype"],
                budget_bytes=int(setup["budget_bytes"]),
                kv_tokens=int(setup["kv_tokens"]),
                lane_policy=setup["lane_policy"],
                prefix_cache=bool(setup["prefix_cache"]),
                speculation=setup.get("speculation"),
                device=setup.get("device", "auto"),
                threads=int(setup.get("threads") or 0),
            )
        )
        self.client = EngineClient(self.engine)

    def run(self, phase: Phase, on_done: Any, timeout: float) -> tuple[list[Any], dict[str, Any]]:
        from polylane.bench.engine_client import engine_counters
        from polylane.bench.replay import replay

        before = engine_counters(self.engine)
        try:
            timelines = asyncio.run(asyncio.wait_for(replay(phase, self.client, on_done), timeout))
        except TimeoutError:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # where the engine stands
            stats = self.engine.stats()
            raise TimeoutError(
                f"phase {phase.name!r} did not finish within {timeout:.0f} s; engine alive "
                f"{self.engine.alive} ({self.engine.error or 'no error'}), {stats.steps} steps; in flight:\n"
                f"{self.client.describe_in_flight()}\nscheduler: {_scheduler_state(self.engine)}"
            ) from None
        return timelines, engine_counters(self.engine).delta(before).to_dict()

    def close(self) -> None:
        self.client.close()
        self.engine.close()


def _scheduler_state(engine: Any) -> str:
    """The scheduler's requests and models as it holds them (diagnostics for a phase that hung)."""
    scheduler = engine.scheduler
    parts = [
        f"{name}={getattr(scheduler, name)!r}"
        for name in ("_requests", "_models")
        if hasattr(scheduler, name)
    ]
    return "; ".join(parts)[:4000]


class _TransformersSystem:
    def __init__(self, setup: dict[str, Any], models: tuple[tuple[str, str], ...]) -> None:
        from polylane.bench.engine_client import resolve_source
        from polylane.bench.hf_client import TransformersRunner

        resolved = tuple((name, resolve_source(source, models)) for name, source in models)
        self.runner = TransformersRunner(
            resolved, setup["dtype"], setup.get("assisted"), setup.get("device", "auto")
        )
        self.runner.load_all()
        self.runner.warm_up()

    def run(self, phase: Phase, on_done: Any, timeout: float) -> tuple[list[Any], None]:
        return self.runner.run(phase, on_done), None  # generate runs in this thread: no watchdog

    def close(self) -> None:
        pass


class _LlamaCppSystem(_TransformersSystem):
    def __init__(self, setup: dict[str, Any], models: tuple[tuple[str, str], ...]) -> None:
        from polylane.bench.engine_client import resolve_source
        from polylane.bench.llamacpp_client import LlamaCppRunner

        resolved = tuple((name, resolve_source(source, models)) for name, source in models)
        self.runner = LlamaCppRunner(resolved, int(setup.get("threads") or 0))  # type: ignore[assignment]
        self.runner.load_all()
        self.runner.warm_up()


if __name__ == "__main__":
    sys.exit(main())
