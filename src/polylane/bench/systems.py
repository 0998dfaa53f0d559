"""The systems a bench compares, as the harness drives them: open, run a phase, close. No torch.

What this module owns: what each system name means, and the parent's side of running it — local
systems in worker processes (`worker.py`), a running server through `http_client`. A system is
opened (loaded and warmed up) before its turn in a repeat and closed after it, so only one
system holds memory at a time and none keeps a prefix cache from an earlier repeat.

Systems:
- `polylane`: the system under test. One engine serving every model, one decode lane, prefix
  cache on, the first model speculating as `SystemSettings.speculation` says (with `--url`: the
  server at that address, through the `openai` client).
- `polylane-auto`, `polylane-chain`, `polylane-tree`: the same with the speculation mode forced
  (`SpeculationConfig.mode`), run beside `polylane` so chain and tree are measured in one run.
- `plain`: the same engine with the prefix cache and speculation off: the baseline for what
  caching and drafting buy.
- `per-process`: one polylane engine per model, each in its own process, started together; each
  gets its model's share of every phase with the same arrival times and a concurrency cap scaled to
  its share (`Phase.only`), the way one-process-per-model servers are deployed. Timelines of the
  processes are merged on their common start; engine counters are added up.
- `transformers`: Hugging Face `generate` on the same GGUF at the same dtype (`hf_client`).
- `transformers-assisted`: transformers assisted generation with `SystemSettings.drafter` as the
  assistant model, or n-gram prompt lookup when no drafter is given.
- `transformers-lookup`: transformers prompt lookup (n-gram, `prompt_lookup_num_tokens=10`).
- `llama.cpp`: llama.cpp's Python bindings on the same GGUF file, its own quantised weights and
  kernels, one sequence at a time (`llamacpp_client`; `pip install 'polylane[llamacpp]'`).

Baselines serve `SystemSettings.baseline_models` (the spec bench: the target alone, since the other
models only draft for it) or every model.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from polylane.bench.metrics import EngineCounters, RequestTimeline, merge_counters
from polylane.bench.workloads import Phase
from polylane.types import DEFAULT_DTYPE

SPEC_MODES = ("auto", "chain", "tree")
VARIANT_PREFIX = "polylane-"  # polylane-<mode>: polylane with its speculation mode forced
SYSTEMS: dict[str, str] = {
    "polylane": "polylane: one engine, every model, one decode lane, prefix cache on",
    **{
        f"{VARIANT_PREFIX}{mode}": f"polylane with speculation mode {mode} (the controller may still "
        "decode plainly where drafting loses, unless adaptive is off)"
        for mode in SPEC_MODES
    },
    "plain": "polylane with the prefix cache and speculation off",
    "per-process": "one polylane process per model, all at once, each serving its model's share",
    "transformers": "Hugging Face transformers generate on the same GGUF, same dtype",
    "transformers-assisted": "transformers assisted generation (the drafter, or n-gram prompt lookup)",
    "transformers-lookup": "transformers n-gram prompt lookup (prompt_lookup_num_tokens=10)",
    "llama.cpp": "llama.cpp (llama-cpp-python) on the same GGUF, its own weights, one sequence at a time",
}
VARIANTS = tuple(name for name in SYSTEMS if name.startswith(VARIANT_PREFIX))
BASELINES = tuple(name for name in SYSTEMS if name != "polylane" and name not in VARIANTS)
DEFAULT_BASELINES: dict[str, tuple[str, ...]] = {
    "single": ("transformers",),
    "mix": ("plain", "per-process"),
    "shared-prefix": ("plain",),
    "spec": ("plain", "transformers-assisted", "transformers-lookup"),
    "structured": ("plain",),
}


@dataclass(frozen=True)
class SystemSettings:
    """What every local system is built with."""

    models: tuple[tuple[str, str], ...]  # (served name, catalogue name or path)
    dtype: str = DEFAULT_DTYPE
    budget_bytes: int = 64 * 2**30
    kv_tokens: int = 2048
    lane_policy: str = "throughput"
    threads: int = 0  # compute threads per process (0: polylane adapts to the load, others torch's default)
    device: str = "auto"  # where polylane's engines run (`runtime.model.device`)
    drafter: str | None = None  # transformers-assisted: the assistant model's source
    # polylane's speculation for the first model, as `Engine.add_model(speculation=...)` takes it
    # (JSON-able: True, drafter names, or a dict of `SpeculationConfig` fields); None: none.
    speculation: Any = None
    baseline_models: tuple[tuple[str, str], ...] | None = None  # None: `models`

    @property
    def served_by_baselines(self) -> tuple[tuple[str, str], ...]:
        return self.models if self.baseline_models is None else self.baseline_models


@dataclass
class PhaseRun:
    timelines: list[RequestTimeline]
    engine: EngineCounters | None


class System:
    name: str
    transport: str  # in-process engine in a worker | http | processes | transformers

    def open(self) -> float:
        """Load and warm up; the seconds it took."""
        raise NotImplementedError

    timeout_s: float = 3600.0  # the most one phase run may take

    def run(self, phase: Phase, on_done: Callable[[], None]) -> PhaseRun:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class WorkerError(RuntimeError):
    """A worker process failed; the message carries the end of its stderr."""


class _Worker:
    def __init__(self, label: str, setup: dict[str, Any]) -> None:
        self.label = label
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "polylane.bench.worker"],
            env=_worker_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.send({"op": "start", **setup})

    def send(self, message: dict[str, Any]) -> None:
        stdin: TextIO = self.process.stdin  # type: ignore[assignment]
        stdin.write(json.dumps(message) + "\n")
        stdin.flush()

    def receive(self) -> dict[str, Any]:
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        if not line:
            code = self.process.wait()
            raise WorkerError(f"{self.label} worker exited (status {code}):\n{self.stderr_tail()}")
        message = json.loads(line)
        if message.get("event") == "error":
            raise WorkerError(f"{self.label} worker: {message['message']}\n{self.stderr_tail()}")
        return message

    def stderr_tail(self, characters: int = 3000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-characters:]

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.send({"op": "quit"})
                self.process.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.log.close()


def _worker_env() -> dict[str, str]:
    """The environment of a worker: this process's, with the folder this polylane was imported from
    first on the path, so a worker runs the same code as the harness whatever is installed."""
    import polylane

    source = str(Path(polylane.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": source + (os.pathsep + path if path else "")}


class WorkerSystem(System):
    """A local system: one worker process, or one per model (`per_model`)."""

    def __init__(self, name: str, setup: dict[str, Any], models: Sequence[tuple[str, str]], per_model: bool):
        self.name = name
        self.transport = "processes" if per_model else "worker"
        self.setup = setup
        self.models = tuple(models)
        self.per_model = per_model
        self.workers: dict[str, _Worker] = {}

    def open(self) -> float:
        if self.per_model:  # a sibling:N source names the first model as its provider: resolved here
            from polylane.bench.engine_client import resolve_source

            models = tuple(self.models)
            groups = [(n, [(n, resolve_source(s, models))]) for n, s in models]
        else:
            groups = [("all", list(self.models))]
        try:
            for key, models in groups:  # all start at once: the loads overlap, as they would
                self.workers[key] = _Worker(f"{self.name}/{key}", {**self.setup, "models": models})
            return max(worker.receive()["load_seconds"] for worker in self.workers.values())
        except BaseException:
            self.close()
            raise

    def run(self, phase: Phase, on_done: Callable[[], None]) -> PhaseRun:
        if self.per_model:
            parts = {key: phase.only(key) for key in self.workers}
            parts = {key: part for key, part in parts.items() if part.requests}
        else:
            parts = {"all": phase}
        for key, part in parts.items():  # the start signals go out back to back
            self.workers[key].send({"op": "run", "phase": part.to_dict(), "timeout_s": self.timeout_s})
        results: dict[str, dict[str, Any] | BaseException] = {}
        lock = threading.Lock()

        def collect(key: str) -> None:
            worker = self.workers[key]
            try:
                while True:
                    message = worker.receive()
                    if message["event"] == "done":
                        with lock:
                            on_done()
                    elif message["event"] == "result":
                        results[key] = message
                        return
            except BaseException as error:
                results[key] = error

        threads = [threading.Thread(target=collect, args=(key,), daemon=True) for key in parts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for outcome in results.values():
            if isinstance(outcome, BaseException):
                raise outcome
        messages = [r for r in results.values() if isinstance(r, dict)]
        timelines = [RequestTimeline.from_dict(t) for m in messages for t in m["timelines"]]
        counters = [EngineCounters.from_dict(m["engine"]) for m in messages if m["engine"] is not None]
        engine = None
        if counters:
            engine = counters[0] if not self.per_model else merge_counters(counters)
        order = {r.request_id: i for i, r in enumerate(phase.requests)}
        timelines.sort(key=lambda t: order.get(t.request_id, len(order)))
        return PhaseRun(timelines, engine)

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers = {}


class UrlSystem(System):
    """A running OpenAI-compatible server (polylane's own exports engine counters on /metrics)."""

    def __init__(self, name: str, url: str, api_key: str | None, models: Sequence[str]) -> None:
        self.name = name
        self.transport = "http"
        self.url = url
        self.api_key = api_key
        self.models = tuple(models)

    def _client(self) -> Any:
        from polylane.bench.http_client import HttpClient

        return HttpClient(self.url, self.api_key)

    def open(self) -> float:
        served = self._client().models
        missing = [m for m in self.models if m not in served]
        if missing:
            raise ValueError(f"{self.url} does not serve {missing}; it serves {served}")
        return 0.0

    def run(self, phase: Phase, on_done: Callable[[], None]) -> PhaseRun:
        from polylane.bench.replay import replay

        async def go() -> tuple[list[RequestTimeline], Any]:
            client = self._client()  # an AsyncOpenAI client belongs to one event loop
            try:
                before = client.counters()
                timelines = await asyncio.wait_for(replay(phase, client, lambda _: on_done()), self.timeout_s)
                after = client.counters()
            finally:
                await client.close()
            engine = after.delta(before) if before is not None and after is not None else None
            return timelines, engine

        timelines, engine = asyncio.run(go())
        return PhaseRun(timelines, engine)

    def close(self) -> None:
        pass


def make_system(
    name: str,
    settings: SystemSettings,
    url: str | None = None,
    api_key: str | None = None,
    timeout_s: float = 3600.0,
) -> System:
    """The system `name` (see the module docstring); `url`: polylane runs against that server."""
    system = _make_system(name, settings, url, api_key)
    system.timeout_s = timeout_s
    return system


def _make_system(name: str, settings: SystemSettings, url: str | None, api_key: str | None) -> System:
    engine_setup: dict[str, Any] = {
        "kind": "engine",
        "dtype": settings.dtype,
        "budget_bytes": settings.budget_bytes,
        "kv_tokens": settings.kv_tokens,
        "lane_policy": settings.lane_policy,
        "prefix_cache": True,
        "threads": settings.threads,
        "speculation": settings.speculation,
        "device": settings.device,
    }
    baseline_models = settings.served_by_baselines
    if name == "polylane":
        if url is not None:
            return UrlSystem(name, url, api_key, [n for n, _ in settings.models])
        return WorkerSystem(name, engine_setup, settings.models, per_model=False)
    if name in VARIANTS:
        mode = name.removeprefix(VARIANT_PREFIX)
        setup = {**engine_setup, "speculation": with_mode(settings.speculation, mode)}
        return WorkerSystem(name, setup, settings.models, per_model=False)
    if name == "plain":
        plain = {**engine_setup, "prefix_cache": False, "speculation": None}
        return WorkerSystem(name, plain, baseline_models, per_model=False)
    if name == "per-process":  # polylane deployed one process per model: it speculates alike
        return WorkerSystem(name, engine_setup, baseline_models, per_model=True)
    if name in ("transformers", "transformers-assisted", "transformers-lookup"):
        setup = {
            "kind": "transformers",
            "dtype": settings.dtype,
            "threads": settings.threads,
            "device": settings.device,
        }
        if name == "transformers-assisted":
            setup["assisted"] = settings.drafter or "prompt-lookup"
        elif name == "transformers-lookup":
            setup["assisted"] = "prompt-lookup"
        return WorkerSystem(name, setup, baseline_models, per_model=False)
    if name == "llama.cpp":
        setup = {"kind": "llama.cpp", "threads": settings.threads}
        return WorkerSystem(name, setup, baseline_models, per_model=False)
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def with_mode(speculation: Any, mode: str) -> dict[str, Any]:
    """`speculation` (as `Engine.add_model` takes it) with its mode set to `mode`."""
    if speculation is None or speculation is False:
        raise ValueError(f"{VARIANT_PREFIX}{mode} needs speculation (--speculation)")
    if speculation is True:
        return {"mode": mode}
    if isinstance(speculation, str):
        return {"drafters": [speculation], "mode": mode}
    if isinstance(speculation, list | tuple):
        return {"drafters": list(speculation), "mode": mode}
    return {**speculation, "mode": mode}
