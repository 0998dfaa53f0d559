"""polylane under Ray Serve: two replicas, three models, routed by model through one ingress.

One module-level fixture starts a local Ray (`address="local"`, 2 CPUs) and always shuts it down;
the app (two replicas of one CPU and one torch thread each, an API key) is deployed once for the
module. The checks: the ingress answers the OpenAI routes (the official client, streaming
included) and aggregates `/v1/models`; requests for a model stick to the replica holding it;
greedy output and error bodies equal the single-process server's; a replica killed (SIGKILL)
mid-run ends each of its in-flight requests with a clear error, never a hang, and Ray replaces it.

The group skips with a visible reason where `ray` is not installed (`pip install 'polylane[ray]'`;
the `test` extra installs it, so CI runs it).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

pytest.importorskip("ray", reason="ray is not installed: pip install 'polylane[ray]' to run tests/ray")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'polylane[ray]'")

import ray
from ray import serve

from polylane.server.config import ModelDecl, ServerConfig
from polylane.server.ray_app import RayOptions, build_application
from polylane.server.ray_replica import REPLICA_HEADER
from tests.conftest import fetch_or_skip
from tests.server.conftest import (
    ALL_MODELS,
    API_KEY,
    BUDGET,
    GEMMA,
    KV_TOKENS,
    SMOL,
    LiveServer,
    _free_port,
    assert_error,
    sse_events,
    start_server,
    wait_until,
)

MESSAGES = [{"role": "user", "content": "Name a primary colour."}]
PROMPT = "The capital of France is"
MAX_TOKENS = 8
APP = "polylane-test"


@dataclass
class RayServer:
    base_url: str

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout, headers=self.headers())

    def openai(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def models(self) -> dict[str, dict[str, Any]]:
        with self.client() as client:
            response = client.get("/v1/models")
        assert response.status_code == 200, response.text
        return {entry["id"]: entry for entry in response.json()["data"]}

    def holders(self, model: str) -> set[str]:
        """The replicas reporting `model` resident."""
        return {r["replica"] for r in self.models()[model]["replicas"] if r["state"] == "resident"}

    def replicas(self) -> list[dict[str, Any]]:
        """The live replicas' reports (replica id and pid), from the ingress's directory."""
        from polylane.server.ray_replica import get_directory

        return ray.get(get_directory(APP).reports.remote(3.0))


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    for name in ALL_MODELS:
        fetch_or_skip(name)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 * 2**20,
    )
    try:
        yield
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def ray_server(ray_cluster: None) -> Iterator[RayServer]:
    config = ServerConfig(
        # fp32 where outputs are compared with the single-process server (SmolLM2's); Gemma and
        # Qwen only need a home: "auto" reads their GGUF blocks in place (about 1 s a load), where
        # fp32 or bf16 dequantised them (15-20 s on a replica's one thread) or read a conversion
        models=tuple(
            ModelDecl(name, name, dtype="fp32" if name == SMOL else "auto", kv_tokens=KV_TOKENS)
            for name in ALL_MODELS
        ),
        budget_bytes=BUDGET,
        api_key=API_KEY,
    )
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    options = RayOptions(replicas=2, cpus_per_replica=1, threads_per_replica=1, app_name=APP)
    serve.run(build_application(config, options), name=APP, route_prefix="/")
    live = RayServer(f"http://127.0.0.1:{port}")
    wait_until(lambda: len(live.replicas()) == 2, timeout=60, what="both replicas to report")
    yield live


@pytest.fixture(scope="module")
def single(ray_server: RayServer) -> Iterator[LiveServer]:
    """The single-process server, for the reference outputs and errors (Gemma is registered for
    its errors, never loaded: the outputs compared are SmolLM2's, fp32)."""
    live = start_server((SMOL, GEMMA))
    try:
        yield live
    finally:
        live.stop()


def _chat(server: Any, model: str, **extra: Any) -> httpx.Response:
    with server.client() as client:
        return client.post(
            "/v1/chat/completions",
            json={"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0, **extra},
        )


def _complete(server: Any, model: str, **extra: Any) -> httpx.Response:
    with server.client() as client:
        return client.post(
            "/v1/completions",
            json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **extra},
        )


# ---------------------------------------------------------------------- routes


def test_health_models_and_key(ray_server: RayServer) -> None:
    with httpx.Client(base_url=ray_server.base_url, timeout=30) as anonymous:
        for probe in ("/health", "/health/live", "/health/ready"):
            health = anonymous.get(probe)
            assert health.status_code == 200, health.text
            assert health.json()["replicas"] == 2
        assert_error(anonymous.get("/v1/models"), 401, code="invalid_api_key")
        assert_error(
            anonymous.post("/v1/completions", json={"model": SMOL, "prompt": "x"}),
            401,
            code="invalid_api_key",
        )
    with ray_server.openai(timeout=60) as client:
        listed = {model.id: model.model_dump() for model in client.models.list()}
        assert client.models.retrieve(SMOL).id == SMOL
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("no-such-model")
    assert list(listed) == list(ALL_MODELS), "every served model once, in declared order"
    for model in listed.values():
        assert {r["replica"] for r in model["replicas"]} == {r["replica"] for r in ray_server.replicas()}
        assert model["max_context"] > 0
    assert listed[GEMMA]["chat"] is False


def test_requests_stick_to_the_replica_that_holds_their_model(ray_server: RayServer) -> None:
    placed: dict[str, str] = {}
    for model in ALL_MODELS:  # one at a time: each load is seen by Ray's router before the next
        response = _complete(ray_server, model, max_tokens=2)
        assert response.status_code == 200, response.text
        placed[model] = response.headers[REPLICA_HEADER]
        wait_until(lambda m=model: placed[m] in ray_server.holders(m), timeout=10, what=f"{model} resident")
    time.sleep(0.5)  # Ray's routers learn a replica's models within ~0.1 s of a load
    assert placed[SMOL] != placed[GEMMA], (
        f"the second model should load on the replica with fewer models: {placed}"
    )
    for _ in range(3):
        for model in ALL_MODELS:
            response = _complete(ray_server, model, max_tokens=2)
            assert response.status_code == 200, response.text
            assert response.headers[REPLICA_HEADER] == placed[model], (model, placed)
    for model in ALL_MODELS:
        assert ray_server.holders(model) == {placed[model]}, f"{model} loaded on a second replica"
    listed = ray_server.models()
    assert all(listed[model]["state"] == "resident" for model in ALL_MODELS), listed


def test_greedy_output_equals_the_single_process_server(ray_server: RayServer, single: LiveServer) -> None:
    for route in (_complete, _chat):
        expected, got = route(single, SMOL), route(ray_server, SMOL)
        assert got.status_code == expected.status_code == 200, got.text
        assert got.headers["content-type"] == expected.headers["content-type"]
        want, have = expected.json(), got.json()
        assert have["choices"] == want["choices"], (route.__name__, have, want)
        assert have["usage"] == want["usage"]
        assert have["model"] == SMOL


def test_streaming_through_the_ingress(ray_server: RayServer, single: LiveServer) -> None:
    expected = _chat(single, SMOL).json()["choices"][0]
    with ray_server.openai(timeout=60) as client:
        chunks = list(
            client.chat.completions.create(
                model=SMOL,
                messages=MESSAGES,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["message"]["content"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [expected["finish_reason"]]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    with (
        ray_server.client() as client,
        client.stream(
            "POST",
            "/v1/completions",
            json={"model": GEMMA, "prompt": PROMPT, "max_tokens": 4, "stream": True},
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response.iter_lines()))
    assert events[-1] == "[DONE]" and all(isinstance(e, dict) and "error" not in e for e in events[:-1])


def test_errors_are_the_single_process_servers(ray_server: RayServer, single: LiveServer) -> None:
    cases: list[tuple[str, Any]] = [
        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
        ("/v1/completions", {"model": SMOL, "prompt": "x", "max_tokens": -1}),
        ("/v1/completions", {"model": SMOL, "prompt": ""}),
        ("/v1/chat/completions", {"model": GEMMA, "messages": MESSAGES}),
        ("/v1/completions", b"{not json"),
    ]
    for path, body in cases:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        with single.client() as a, ray_server.client() as b:
            want, got = (
                a.post(path, content=content, headers=headers),
                b.post(path, content=content, headers=headers),
            )
        assert got.status_code == want.status_code, (body, got.text, want.text)
        error = assert_error(got, want.status_code)
        if body != cases[0][1]:  # the unknown-model 404 lists the served models, the same on both
            assert error == want.json()["error"], (body, error)
    with ray_server.client() as client:
        assert_error(client.post("/admin/models/x/evict"), 404, code="not_available_under_ray")
        assert_error(client.get("/no/such/route"), 404)


def test_metrics_carry_a_replica_label(ray_server: RayServer) -> None:
    with ray_server.client() as client:
        text = client.get("/metrics").text
    replicas = {r["replica"] for r in ray_server.replicas()}
    for replica in replicas:
        assert f'replica="{replica}"' in text
    assert text.count("# TYPE polylane_") == len({line for line in text.splitlines() if "# TYPE" in line})


# ---------------------------------------------------------------------- replica failure


def _stream_outcome(server: RayServer, model: str, max_tokens: int, started: threading.Event) -> dict:
    """Stream one completion; report how it ended: "completed" or "error" (and the events)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True  # it runs until max_tokens, so it is still running at the kill
    with server.client(timeout=90) as client, client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            return {"outcome": "error", "status": response.status_code, "body": response.json()}
        events = []
        for event in sse_events(response.iter_lines()):
            events.append(event)
            started.set()
    assert events and events[-1] == "[DONE]", f"the stream ended without [DONE]: {events[-3:]}"
    errors = [e for e in events[:-1] if "error" in e]
    if errors:
        return {"outcome": "error", "status": 200, "body": errors[-1], "events": events}
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert finishes, events
    return {"outcome": "completed", "finish": finishes[-1]}


def _plain_outcome(server: RayServer, model: str, max_tokens: int) -> dict:
    response = _complete(server, model, max_tokens=max_tokens, ignore_eos=True)
    if response.status_code == 200:
        return {"outcome": "completed", "finish": response.json()["choices"][0]["finish_reason"]}
    return {"outcome": "error", "status": response.status_code, "body": response.json()}


def test_a_killed_replica_fails_its_requests_clearly_and_is_replaced(ray_server: RayServer) -> None:
    victim_replica = next(iter(ray_server.holders(SMOL)))
    survivor = ray_server.holders(GEMMA)
    assert victim_replica not in survivor, "SMOL and GEMMA should live on different replicas"
    victim = next(r for r in ray_server.replicas() if r["replica"] == victim_replica)

    outcomes: dict[str, dict] = {}
    streams_started = [threading.Event() for _ in range(3)]
    jobs: dict[str, Any] = {
        f"smol-stream-{i}": (_stream_outcome, SMOL, 64, e) for i, e in enumerate(streams_started)
    }
    jobs["smol-plain"] = (_plain_outcome, SMOL, 64)
    gemma_started = threading.Event()
    jobs["gemma-stream"] = (_stream_outcome, GEMMA, 24, gemma_started)

    def run(name: str, job: tuple) -> None:
        try:
            outcomes[name] = job[0](ray_server, *job[1:])
        except Exception as error:  # a broken connection or a malformed stream is a silent loss
            outcomes[name] = {"outcome": "broken", "error": repr(error)}
        outcomes[name]["ended"] = time.monotonic()

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in jobs.items()]
    for thread in threads:
        thread.start()
    for event in streams_started:
        assert event.wait(60), "a SMOL stream never started"
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(timeout=90)
    hung = [name for name, thread in zip(jobs, threads, strict=True) if thread.is_alive()]
    assert not hung, f"requests still running {time.monotonic() - killed_at:.0f} s after the kill: {hung}"
    assert set(outcomes) == set(jobs), outcomes

    broken = {name: o for name, o in outcomes.items() if o["outcome"] == "broken"}
    assert not broken, f"requests that ended without an answer or an error: {broken}"
    assert outcomes["gemma-stream"]["outcome"] == "completed", outcomes["gemma-stream"]
    on_victim = [outcomes[name] for name in jobs if name.startswith("smol")]
    assert any(o["outcome"] == "error" for o in on_victim), f"no request saw the kill: {on_victim}"
    for outcome in on_victim:
        if outcome["outcome"] == "completed":  # it may have reached EOS before the kill
            assert outcome["ended"] < killed_at, f"completed on a killed replica: {outcome}"
            continue
        error = outcome["body"]["error"]
        assert error["code"] == "replica_failed" and error["type"], outcome
        assert outcome["status"] in (200, 503), outcome  # 200: the stream had started

    def replaced() -> bool:
        replicas = {r["replica"] for r in ray_server.replicas()}
        return len(replicas) == 2 and victim_replica not in replicas

    wait_until(replaced, timeout=90, what="Ray to replace the killed replica")
    for model in ALL_MODELS:  # new requests are served (SMOL loads again on a live replica)
        response = _complete(ray_server, model, max_tokens=2)
        assert response.status_code == 200, (model, response.text)
        assert response.headers[REPLICA_HEADER] != victim_replica
