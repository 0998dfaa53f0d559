"""Ray Serve benchmark: polylane replicas behind the ingress vs the single-process server.

Run:  python bench/ray.py [--replicas 2] [--clients 8] [--requests 32] [--max-tokens 32]
                          [--latency-requests 20] [--repeats 2] [--dtype fp32]

Both systems run side by side in one run, each in processes of its own (the client threads here
share neither's interpreter): the single-process server is `polylane serve` in a subprocess (one
engine, torch threads = all cores); the Ray app is `--replicas` polylane replicas under a local
Ray Serve (`address="local"`, all cores; each replica reserves cores / replicas CPUs and runs that
many torch threads) behind the ingress, as `polylane serve --ray` deploys it. Both serve SmolLM2
and Gemma 3 (`--dtype`), warmed before the clock starts (under Ray the two models land on two
replicas). Each repeat measures both systems, alternating which goes first.

Metrics (per system, median over repeats):
- latency_ms p50 / mean: one client, `--latency-requests` sequential non-streaming completions
  of SmolLM2 with max_tokens=1 (a short prefill and one token: the request's fixed cost).
- routing_overhead = Ray latency p50 / single-process latency p50 (1.0: routing is free), and
  routing_overhead_ms = their difference. It includes the replica computing on cores / replicas
  torch threads where the single process uses all cores.
- no_model_p50_ms: the same client's GET of a route that does not exist, which both systems
  answer with the app's own 404 (under Ray: Ray's proxy, the ingress, a handle call to a replica,
  the app run in-process there): no model work, so hop_overhead_ms = Ray's minus the single
  process's is the transport cost alone.
- tokens_per_s: `--clients` threads sending `--requests` non-streaming completions in all,
  alternating SmolLM2 / Gemma 3, `--max-tokens` each with EOS ignored; generated tokens / wall
  seconds from the first send to the last answer. requests_per_s likewise.
- throughput_ratio = Ray tokens_per_s / single-process tokens_per_s (above 1: the replicas win).
The last stdout line is one JSON document with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

SMOL, GEMMA = "smollm2-135m-instruct", "gemma3-270m"
MODELS = (SMOL, GEMMA)
PROMPT = "The three laws of motion are"
SUMMARY_KEYS = ("latency_p50_ms", "latency_mean_ms", "no_model_p50_ms", "tokens_per_s", "requests_per_s")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer /health within {timeout:.0f} s")


def complete(client: httpx.Client, model: str, max_tokens: int) -> int:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


def measure_latency(url: str, requests: int) -> dict[str, float]:
    with httpx.Client(base_url=url, timeout=600) as client:
        complete(client, SMOL, 1)  # a connection and a hot path before the clock
        seconds, hops = [], []
        for _ in range(requests):
            started = time.perf_counter()
            complete(client, SMOL, 1)
            seconds.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert client.get("/v1/no-such-route").status_code == 404  # the app's own 404
            hops.append(time.perf_counter() - started)
    return {
        "latency_p50_ms": 1000 * statistics.median(seconds),
        "latency_mean_ms": 1000 * statistics.mean(seconds),
        "no_model_p50_ms": 1000 * statistics.median(hops),
    }


def measure_throughput(url: str, clients: int, requests: int, max_tokens: int) -> dict[str, float]:
    next_index = iter(range(requests))
    lock = threading.Lock()
    tokens = [0]
    failures: list[str] = []

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=600) as client:
            while True:
                with lock:
                    index = next(next_index, None)
                if index is None:
                    return
                try:
                    made = complete(client, MODELS[index % len(MODELS)], max_tokens)
                except httpx.HTTPError as error:
                    failures.append(repr(error))
                    continue
                with lock:
                    tokens[0] += made

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed, e.g. {failures[0]}")
    return {"tokens_per_s": tokens[0] / wall, "requests_per_s": requests / wall, "wall_s": wall}


def start_single(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "polylane.cli", "serve", *MODELS, "--dtype", args.dtype]
    command += ["--budget", "8GiB", "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 300, process)
    return process, url


def start_ray(args: argparse.Namespace) -> str:
    import ray
    from ray import serve

    from polylane.server.config import ModelDecl, ServerConfig
    from polylane.server.ray_app import RayOptions, build_application

    cores = os.cpu_count() or 1
    ray.init(address="local", num_cpus=cores, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = ServerConfig(
        models=tuple(ModelDecl(name, name, dtype=args.dtype) for name in MODELS), budget_bytes=8 * 2**30
    )
    share = cores / args.replicas
    options = RayOptions(
        replicas=args.replicas, cpus_per_replica=share, threads_per_replica=max(1, int(share))
    )
    serve.run(build_application(config, options), name=options.app_name, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 120)
    return url


def warm(url: str) -> list[str]:
    """One request per model, one after the other (so under Ray each lands on its replica)."""
    placed = []
    with httpx.Client(base_url=url, timeout=600) as client:
        for model in MODELS:
            response = client.post(
                "/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2}
            )
            response.raise_for_status()
            placed.append(response.headers.get("x-polylane-replica", "-"))
            time.sleep(0.5)  # Ray's router learns where the model went
    return placed


def main() -> None:
    # `python bench/ray.py` puts bench/ first on sys.path, where this file would shadow Ray itself.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [path for path in sys.path if os.path.abspath(path or ".") != here]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--latency-requests", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args()

    progress("starting the single-process server …")
    single, single_url = start_single(args)
    try:
        progress(f"starting Ray Serve with {args.replicas} replicas …")
        ray_url = start_ray(args)
        urls = {"single": single_url, "ray": ray_url}
        placement = {system: warm(url) for system, url in urls.items()}
        progress(f"warm; under Ray {dict(zip(MODELS, placement['ray'], strict=True))}")
        runs: dict[str, list[dict[str, float]]] = {system: [] for system in urls}
        for repeat in range(args.repeats):
            order = ["single", "ray"] if repeat % 2 == 0 else ["ray", "single"]
            for system in order:
                progress(f"repeat {repeat + 1}/{args.repeats}: {system}")
                run = measure_latency(urls[system], args.latency_requests)
                run |= measure_throughput(urls[system], args.clients, args.requests, args.max_tokens)
                runs[system].append(run)
    finally:
        single.terminate()
        single.wait(timeout=60)
        try:
            import ray
            from ray import serve

            if ray.is_initialized():
                serve.shutdown()
                ray.shutdown()
        except ImportError:
            pass

    def median(system: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[system])

    overhead = median("ray", "latency_p50_ms") / median("single", "latency_p50_ms")
    overhead_ms = median("ray", "latency_p50_ms") - median("single", "latency_p50_ms")
    hop_ms = median("ray", "no_model_p50_ms") - median("single", "no_model_p50_ms")
    throughput = median("ray", "tokens_per_s") / median("single", "tokens_per_s")
    cores = os.cpu_count()
    print(
        f"\nRay Serve ({args.replicas} replicas) vs one process, {cores} cores, {args.dtype}, median of "
        f"{args.repeats} alternating repeats\n"
    )
    print("| system | p50 ms, max_tokens=1 | mean ms | p50 ms, no-model 404 | tokens/s | requests/s |")
    print("|---|---|---|---|---|---|")
    for system, label in (("single", "one process"), ("ray", f"Ray Serve, {args.replicas} replicas")):
        print(
            f"| {label} | {median(system, 'latency_p50_ms'):.1f} | {median(system, 'latency_mean_ms'):.1f} | "
            f"{median(system, 'no_model_p50_ms'):.1f} | {median(system, 'tokens_per_s'):.1f} | "
            f"{median(system, 'requests_per_s'):.2f} |"
        )
    print(
        f"\nrouting overhead per request (Ray p50 / one-process p50): {overhead:.2f}x (+{overhead_ms:.1f} ms)"
    )
    print(f"transport alone (no-model 404, Ray minus one process): +{hop_ms:.1f} ms")
    print(
        f"aggregate throughput, {args.clients} clients x {args.requests} requests x {args.max_tokens} tokens "
        f"over {len(MODELS)} models (Ray / one process): {throughput:.2f}x"
    )
    load = os.getloadavg()
    print(f"Load average (1, 5 min) after the run: {load[0]:.2f}, {load[1]:.2f}\n")
    print(
        json.dumps(
            {
                "replicas": args.replicas,
                "clients": args.clients,
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "latency_requests": args.latency_requests,
                "repeats": args.repeats,
                "dtype": args.dtype,
                "cores": cores,
                "placement_under_ray": dict(zip(MODELS, placement["ray"], strict=True)),
                "summary": {system: {key: median(system, key) for key in SUMMARY_KEYS} for system in runs},
                "routing_overhead": overhead,
                "routing_overhead_ms": overhead_ms,
                "hop_overhead_ms": hop_ms,
                "throughput_ratio": throughput,
                "load_average": load[:2],
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    main()
