"""The reliability harness: a real `polylane serve` under saturation, faults and a shutdown, where
every request must end in an answer or a clear error (`python bench/soak.py`; a short run is in the
test suite, `tests/bench/test_soak.py`).

What this module owns: one soak run and its report. The server is a subprocess started from a
config file that declares the good models (catalogue files, at --dtype) next to three broken ones
made in the work folder (a truncated file and one with a corrupt header, left out at start; one
with a NaN block scale, which fails at its first load). Its budget is then set (`/admin/budget`)
to hold the largest and the smallest good model but not all of them, so requests force evictions.

- **Saturation**: --clients threads send requests for --seconds: completions to random models
  (a tenth to the broken ones), streamed or not, random lengths, a few with bad input; a share of
  the streams (--disconnect) is dropped by the client after its first chunk.
- **Admin faults**, every --admin-every seconds while streams run: evict a model (a 409 while it is
  in use is the expected answer), pin then unpin one, shrink the budget then restore it.
- **Outcomes**, per request: ok (a complete answer: `finish_reason` stop or length and, streamed,
  `[DONE]`), 4xx, 429, 503 (a status, or a final SSE error event), 5xx, disconnected (by the
  client, on purpose), and **lost**: no answer and no error (a transport error, a stream that ends
  without `[DONE]` or an error event, a timeout). Lost must be 0, and 5xx too.
- **KV blocks**: once the queue is empty, every resident model's blocks are free or cached (held by
  no request), read from `polylane_kv_blocks` on /metrics, as before the run.
- **RSS over load/unload cycles**: --cycles rounds of loading each good model (`/admin/models/
  {name}/load`, evicting others for room) and one request to it; the server's RSS after each.
- **SIGTERM mid-load**: a request to an evicted model, and SIGTERM while it loads: the process must
  exit with status 0 and the request end in an answer or an error, not be lost.

Prints a table and, last, one JSON line (`run_soak` returns the same report as a dict).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from prometheus_client.parser import text_string_to_metric_families

from polylane import catalog

GOOD_MODELS = ("smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct")
BROKEN_MODELS = ("truncated", "bad-header", "nan-scales")
PROMPTS = (
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "Write a short poem about the sea.",
    "List three prime numbers:",
    "In 1969, the first",
)
BAD_BODIES = (  # each a 400: a string count, a boolean stream flag as a number, a prompt of strings
    {"max_tokens": "4"},
    {"stream": 0},
    {"prompt": ["12", "34"]},
)
OUTCOMES = ("ok", "4xx", "429", "503", "5xx", "disconnected", "lost")


@dataclass
class SoakOptions:
    clients: int = 32
    seconds: float = 180.0
    models: tuple[str, ...] = GOOD_MODELS
    dtype: str = "auto"
    kv_tokens: int = 1024
    disconnect: float = 0.15  # share of streams the client drops after their first chunk
    admin_every_s: float = 5.0
    cycles: int = 6  # load/unload rounds over the good models for the RSS phase
    drain_timeout_s: float = 5.0
    seed: int = 0
    workdir: Path | None = None  # where the config, broken files and server log go (a temp folder)


@dataclass
class _Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)  # streams answered: time to their first chunk
    latency_s: list[float] = field(default_factory=list)  # non-streamed answers
    lost: list[str] = field(default_factory=list)  # what each lost request saw

    def add(self, outcome: str, status: int | None = None, ttft: float | None = None, why: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if status is not None:
                self.statuses[status] += 1
            if ttft is not None:
                self.ttft_s.append(ttft)
            if outcome == "lost":
                self.lost.append(why)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _broken_files(folder: Path) -> dict[str, Path]:
    """A truncated copy of SmolLM2's file, one with a corrupt header and one with a NaN block scale."""
    from polylane.runtime.loading.gguf_file import GGUFFile

    source = catalog.resolve("smollm2-135m-instruct", quiet=True).path
    data = source.read_bytes()
    files = {name: folder / f"{name}.gguf" for name in BROKEN_MODELS}
    files["truncated"].write_bytes(data[: len(data) * 6 // 10])
    files["bad-header"].write_bytes(b"GGUF" + bytes(range(256)) * 64)
    start = GGUFFile(source).tensors["blk.4.ffn_up.weight"].offset
    nan = bytearray(data)
    nan[start : start + 2] = np.array([np.nan], dtype=np.float16).tobytes()
    files["nan-scales"].write_bytes(bytes(nan))
    return files


def _config(options: SoakOptions, broken: dict[str, Path]) -> str:
    lines = []
    for name in options.models:
        lines += ["[[models]]", f'name = "{name}"', f'dtype = "{options.dtype}"']
        lines += [f"kv_tokens = {options.kv_tokens}"]
    for name, path in broken.items():
        lines += ["[[models]]", f'name = "{name}"', f'source = "{path}"', 'dtype = "auto"', "kv_tokens = 256"]
    return "\n".join(lines) + "\n"


class _Server:
    """`polylane serve` in a subprocess, its log in the work folder."""

    def __init__(self, options: SoakOptions, folder: Path) -> None:
        (folder / "soak.toml").write_text(_config(options, _broken_files(folder)))
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / "serve.log"
        command = [sys.executable, "-m", "polylane.cli", "serve", "--config", str(folder / "soak.toml")]
        command += ["--port", str(self.port), "--drain-timeout", str(options.drain_timeout_s)]
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, cwd=folder)
        deadline = time.monotonic() + 600
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text()[-chars:]

    def rss(self) -> int:
        return psutil.Process(self.process.pid).memory_info().rss

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self._log.close()


def _metrics(http: httpx.Client) -> dict[str, list]:
    text = http.get("/metrics").text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def _kv_blocks(http: httpx.Client) -> dict[str, dict[str, float]]:
    blocks: dict[str, dict[str, float]] = {}
    for sample in _metrics(http).get("polylane_kv_blocks", []):
        blocks.setdefault(sample.labels["model"], {})[sample.labels["use"]] = sample.value
    return blocks


def _request(http: httpx.Client, rng: random.Random, options: SoakOptions, tally: _Tally) -> None:
    broken = rng.random() < 0.1
    model = rng.choice(BROKEN_MODELS if broken else options.models)
    body: dict[str, Any] = {
        "model": model,
        "prompt": rng.choice(PROMPTS),
        "max_tokens": rng.randint(1, 48),
        "temperature": rng.choice([0.0, 0.8]),
        "stream": rng.random() < 0.6,
    }
    if rng.random() < 0.05:
        body |= rng.choice(BAD_BODIES)
    stream = body["stream"] is True
    drop = stream and rng.random() < options.disconnect
    sent = time.monotonic()
    try:
        if not stream:
            response = http.post("/v1/completions", json=body)
            _classify_answer(response.status_code, response, tally, time.monotonic() - sent)
            return
        with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                _classify_answer(response.status_code, response, tally, None)
                return
            _read_stream(response, sent, drop, tally)
    except httpx.HTTPError as error:
        tally.add("lost", why=f"{type(error).__name__}: {error}")


def _classify_answer(status: int, response: httpx.Response, tally: _Tally, latency: float | None) -> None:
    if status == 200:
        choices = response.json().get("choices", [])
        if choices and all(c.get("finish_reason") in ("stop", "length") for c in choices):
            tally.add("ok", status)
            if latency is not None:
                with tally.lock:
                    tally.latency_s.append(latency)
        else:
            tally.add("lost", status, why=f"200 without a finished choice: {response.text[:200]}")
        return
    if "error" not in response.json():
        tally.add("lost", status, why=f"{status} without OpenAI's error shape: {response.text[:200]}")
        return
    kind = "429" if status == 429 else "503" if status == 503 else "4xx" if status < 500 else "5xx"
    tally.add(kind, status)


def _read_stream(response: httpx.Response, sent: float, drop: bool, tally: _Tally) -> None:
    first: float | None = None
    finished = error = done = False
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            done = True
            break
        event = json.loads(payload)
        if first is None:
            first = time.monotonic() - sent
            if drop:
                tally.add("disconnected", 200, ttft=first)
                return  # leaving the `with` closes the connection mid-stream
        if "error" in event:
            error = True
        elif any(c.get("finish_reason") in ("stop", "length") for c in event.get("choices", [])):
            finished = True
    if done and error:
        tally.add("503", 200, ttft=first)
    elif done and finished:
        tally.add("ok", 200, ttft=first)
    else:
        tally.add("lost", 200, why=f"a stream ended without [DONE] or an error (done={done})")


def _client(base: str, options: SoakOptions, seed: int, stop_at: float, tally: _Tally) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=httpx.Timeout(300.0, connect=30.0)) as http:
        while time.monotonic() < stop_at:
            _request(http, rng, options, tally)


def _admin_faults(
    base: str, options: SoakOptions, stop_at: float, budget: int, low: int, seen: Counter
) -> None:
    rng = random.Random(options.seed + 10_000)
    with httpx.Client(base_url=base, timeout=300.0) as http:
        while time.monotonic() < stop_at:
            time.sleep(options.admin_every_s)
            model = rng.choice(options.models)
            fault = rng.choice(("evict", "pin", "budget"))
            if fault == "evict":
                seen[f"evict {http.post(f'/admin/models/{model}/evict').status_code}"] += 1
            elif fault == "pin":
                seen[f"pin {http.post(f'/admin/models/{model}/pin').status_code}"] += 1
                time.sleep(1.0)
                seen[f"unpin {http.post(f'/admin/models/{model}/unpin').status_code}"] += 1
            else:
                seen[f"budget {http.post('/admin/budget', json={'bytes': low}).status_code}"] += 1
                time.sleep(1.0)
                seen[f"budget {http.post('/admin/budget', json={'bytes': budget}).status_code}"] += 1


def _sizes(http: httpx.Client, options: SoakOptions) -> dict[str, int]:
    """The good models' bytes as /v1/models reports them (weights and KV, measured or estimated)."""
    return {m["id"]: m["bytes"] for m in http.get("/v1/models").json()["data"] if m["id"] in options.models}


def _wait_idle(http: httpx.Client, timeout: float = 60.0) -> bool:
    """Until no request is queued and no KV block is held by one (a request ended by its client
    or an abort gives its blocks back at the engine's next step); False if that never comes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        samples = _metrics(http).get("polylane_queue_requests", [])
        held = [s.value for s in _metrics(http).get("polylane_kv_blocks", []) if s.labels["use"] == "held"]
        if samples and samples[0].value == 0 and not any(held):
            return True
        time.sleep(0.5)
    return False


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def run_soak(options: SoakOptions) -> dict[str, Any]:
    for name in options.models:
        catalog.resolve(name, quiet=True)  # fetched before the clock starts
    with tempfile.TemporaryDirectory() as scratch:
        folder = options.workdir or Path(scratch)
        started = time.monotonic()
        server = _Server(options, folder)
        try:
            report = _soak(options, server)
        finally:
            server.stop()
        report["phase_seconds"]["start"] = report["phase_seconds"].pop("_ready_at") - started
        return report


def _soak(options: SoakOptions, server: _Server) -> dict[str, Any]:
    phases: dict[str, float] = {"_ready_at": time.monotonic()}
    mark = time.monotonic()

    def phase(name: str) -> None:
        nonlocal mark
        phases[name] = time.monotonic() - mark
        mark = time.monotonic()

    with httpx.Client(base_url=server.base, timeout=300.0) as http:
        sizes = _sizes(http, options)
        budget = max(sizes.values()) + min(sizes.values()) + (1 << 20)  # not all of them at once
        low = max(sizes.values()) + (1 << 20)
        assert http.post("/admin/budget", json={"bytes": budget}).status_code == 200
        for name in options.models:  # each loaded once: the KV blocks of each seen idle
            http.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1})
        blocks_before = _kv_blocks(http)
        rss_before = server.rss()
        phase("warm-up")

        tally, admin = _Tally(), Counter()
        stop_at = time.monotonic() + options.seconds
        threads = [
            threading.Thread(target=_client, args=(server.base, options, options.seed + i, stop_at, tally))
            for i in range(options.clients)
        ]
        faults = (server.base, options, stop_at, budget, low, admin)
        threads.append(threading.Thread(target=_admin_faults, args=faults))
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        phase("saturation")
        idle = _wait_idle(http)
        phase("settle")
        blocks_after = _kv_blocks(http)
        evictions = sum(
            s.value for s in _metrics(http).get("polylane_evictions", []) if s.name.endswith("_total")
        )

        rss_cycles = []
        for _ in range(options.cycles):
            for name in options.models:
                http.post(f"/admin/models/{name}/load")
                http.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
                rss_cycles.append(server.rss() / 2**20)
        phase("cycles")

        sigterm = _sigterm_mid_load(http, server, options)
        phase("sigterm")
    held_after = {name: blocks.get("held", 0.0) for name, blocks in blocks_after.items()}
    report = {
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items()},
        "seconds": elapsed,
        "sent": sum(tally.outcomes.values()),
        "outcomes": {name: tally.outcomes.get(name, 0) for name in OUTCOMES},
        "statuses": dict(sorted(tally.statuses.items())),
        "lost_details": tally.lost[:10],
        "ttft_p50_s": _percentile(tally.ttft_s, 50),
        "ttft_p99_s": _percentile(tally.ttft_s, 99),
        "latency_p50_s": _percentile(tally.latency_s, 50),
        "admin": dict(sorted(admin.items())),
        "evictions": evictions,
        "idle_after": idle,
        "kv_blocks_before": blocks_before,
        "kv_blocks_after": blocks_after,
        "kv_held_after": held_after,
        "rss_before_mib": rss_before / 2**20,
        "rss_cycles_mib": rss_cycles,
        "sigterm": sigterm,
        "phase_seconds": phases,
    }
    return report


def _sigterm_mid_load(http: httpx.Client, server: _Server, options: SoakOptions) -> dict[str, Any]:
    """Evict the largest good model, ask it for a completion (so it loads), SIGTERM meanwhile."""
    sizes = _sizes(http, options)
    target = max(sizes, key=sizes.__getitem__)
    http.post(f"/admin/models/{target}/evict")
    tally = _Tally()
    body = {"model": target, "prompt": "Hello", "max_tokens": 4}
    asking = threading.Thread(target=lambda: _classify_post(server.base, body, tally))
    asking.start()
    time.sleep(0.3)
    stopped = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(timeout=options.drain_timeout_s + 60)
    except subprocess.TimeoutExpired:
        code = None
    asking.join(timeout=60)
    outcome = next(iter(tally.outcomes), "lost")
    return {"model": target, "exit_code": code, "exit_s": time.monotonic() - stopped, "request": outcome}


def _classify_post(base: str, body: dict[str, Any], tally: _Tally) -> None:
    try:
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        _classify_answer(response.status_code, response, tally, None)
    except httpx.HTTPError as error:
        tally.add("lost", why=f"{type(error).__name__}: {error}")


def print_report(report: dict[str, Any]) -> None:
    options = report["options"]
    print(
        f"soak: {options['clients']} clients for {report['seconds']:.0f} s over "
        f"{', '.join(options['models'])} (dtype {options['dtype']}) and {len(BROKEN_MODELS)} broken "
        "models; the budget below all of them"
    )
    print("| sent | " + " | ".join(OUTCOMES) + " |")
    print("|---:|" + "---:|" * len(OUTCOMES))
    print(f"| {report['sent']} | " + " | ".join(str(report["outcomes"][o]) for o in OUTCOMES) + " |")

    def seconds(value: float | None) -> str:
        return "—" if value is None else f"{value:.2f} s"

    print(
        f"TTFT of answered streams: p50 {seconds(report['ttft_p50_s'])}, "
        f"p99 {seconds(report['ttft_p99_s'])}; "
        f"non-streamed latency p50 {seconds(report['latency_p50_s'])}; evictions {report['evictions']:.0f}"
    )
    print(f"admin faults: {report['admin']}")
    print(f"KV blocks held by no request after (idle {report['idle_after']}): held {report['kv_held_after']}")
    print(f"  before: {report['kv_blocks_before']}\n  after:  {report['kv_blocks_after']}")
    cycles = report["rss_cycles_mib"]
    if cycles:
        print(
            f"server RSS: {report['rss_before_mib']:.0f} MiB before the soak; "
            f"over {len(cycles)} loads after it "
            f"first {cycles[0]:.0f}, last {cycles[-1]:.0f}, max {max(cycles):.0f} MiB"
        )
    sigterm = report["sigterm"]
    print(
        f"SIGTERM while {sigterm['model']} loads: exit code {sigterm['exit_code']} "
        f"after {sigterm['exit_s']:.1f} s, "
        f"the request: {sigterm['request']}"
    )
    if report["lost_details"]:
        print("lost:", *report["lost_details"], sep="\n  ")
    print(json.dumps(report))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = SoakOptions()
    parser.add_argument("--clients", type=int, default=defaults.clients)
    parser.add_argument("--seconds", type=float, default=defaults.seconds)
    parser.add_argument("--models", default=",".join(defaults.models))
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--kv-tokens", type=int, default=defaults.kv_tokens)
    parser.add_argument("--disconnect", type=float, default=defaults.disconnect)
    parser.add_argument("--admin-every", type=float, default=defaults.admin_every_s)
    parser.add_argument("--cycles", type=int, default=defaults.cycles)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--workdir", type=Path, help="keep the config, broken files and server log here")
    args = parser.parse_args(argv)
    options = SoakOptions(
        clients=args.clients,
        seconds=args.seconds,
        models=tuple(args.models.split(",")),
        dtype=args.dtype,
        kv_tokens=args.kv_tokens,
        disconnect=args.disconnect,
        admin_every_s=args.admin_every,
        cycles=args.cycles,
        seed=args.seed,
        workdir=args.workdir,
    )
    print_report(run_soak(options))


if __name__ == "__main__":
    main()
