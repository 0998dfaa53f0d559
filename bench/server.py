"""Server benchmark: 32 concurrent streaming clients over three models, through HTTP and direct.

Run:  python bench/server.py [--clients 32] [--max-tokens 16] [--dtype fp32] [--repeats 2]

One process runs the real server (uvicorn on 127.0.0.1, the same app as `polylane serve`) over one
engine with SmolLM2, Gemma 3 and Qwen 0.5B resident (warmed before the clock starts). Each repeat
runs the same workload twice, alternating the order:
- http: `--clients` threads, each one streaming completion through the official `openai` client
  (prompts spread round-robin over the three models, greedy, EOS ignored so every request makes
  exactly --max-tokens tokens);
- direct: the same requests submitted to the same engine in-process (`Engine.submit`, one thread
  per request iterating its stream): no HTTP, no JSON, no SSE.

Metrics:
- requests_per_s: requests / wall seconds from the first send to the last token.
- ttft p50/p99: seconds from sending a request to its first streamed token, as the client sees it.
- seconds_per_token: wall seconds / all generated tokens (aggregate).
- overhead_per_token = http seconds_per_token / direct seconds_per_token (1.0: free).
The last stdout line is one JSON document with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

from polylane.engine_stats import percentile
from polylane.server.app import build_state, create_app
from polylane.server.config import Limits, ModelDecl, ServerConfig
from polylane.types import SamplingParams

MODELS = ("smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct")
PROMPTS = (
    "Write a haiku about autumn leaves.",
    "def is_prime(n):",
    "Summarise the plot of Hamlet in one sentence.",
    "Extract the email from: contact Jane at jane.doe@example.com for details.",
    "The three laws of motion are",
    "SELECT COUNT(*) FROM",
    "Give me a packing list for a weekend hike.",
    "Translate to Spanish: good morning, friends.",
)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_http(port: int, args: argparse.Namespace) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    ttft: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def one(index: int) -> None:
        sent = time.perf_counter()
        stream = client.completions.create(
            model=MODELS[index % len(MODELS)],
            prompt=PROMPTS[index % len(PROMPTS)],
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        first = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - sent
            if chunk.usage is not None:
                with lock:
                    tokens[0] += chunk.usage.completion_tokens
        with lock:
            ttft.append(first if first is not None else time.perf_counter() - sent)

    return _timed(one, args.clients, ttft, tokens)


def run_direct(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    ttft: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def one(index: int) -> None:
        sent = time.perf_counter()
        model = MODELS[index % len(MODELS)]
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        handle = engine.submit(model, PROMPTS[index % len(PROMPTS)], params=params)
        first = None
        for event in handle:
            if first is None and event.text:
                first = time.perf_counter() - sent
        with lock:
            tokens[0] += len(handle.result().token_ids)
            ttft.append(first if first is not None else time.perf_counter() - sent)

    return _timed(one, args.clients, ttft, tokens)


def _timed(one: Any, clients: int, ttft: list[float], tokens: list[int]) -> dict[str, Any]:
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return {
        "requests_per_s": clients / wall,
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "tokens": tokens[0],
        "seconds_per_token": wall / max(1, tokens[0]),
        "wall_s": wall,
    }


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    config = ServerConfig(
        models=tuple(ModelDecl(name, name, args.dtype, kv_tokens=2048) for name in MODELS),
        budget_bytes=64 * 2**30,
        limits=Limits(max_waiting_requests=1024),
    )
    progress("starting the server with three models …")
    state = build_state(config, quiet=True)
    for name in MODELS:
        state.engine.generate(name, "Hello", SamplingParams(max_tokens=2))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    results: dict[str, list[dict[str, Any]]] = {"http": [], "direct": []}
    for repeat in range(args.repeats):
        order = ["http", "direct"] if repeat % 2 == 0 else ["direct", "http"]
        for system in order:
            progress(f"repeat {repeat + 1}/{args.repeats}: {system}")
            run = run_http(port, args) if system == "http" else run_direct(state.engine, args)
            results[system].append(run)
    stats = state.engine.stats()
    server.should_exit = True
    thread.join()

    def median(system: str, key: str) -> float:
        return statistics.median(r[key] for r in results[system])

    overhead = median("http", "seconds_per_token") / median("direct", "seconds_per_token")
    print(
        f"\n{args.clients} concurrent streaming requests over {len(MODELS)} models, "
        f"{args.max_tokens} tokens each, "
        f"{args.dtype}, median of {args.repeats} alternating repeats, {os.cpu_count()} cores\n"
    )
    print("| path | requests/s | TTFT p50 ms | TTFT p99 ms | ms per token (aggregate) |")
    print("|---|---|---|---|---|")
    for system in results:
        print(
            f"| {system} | {median(system, 'requests_per_s'):.2f} | {median(system, 'ttft_p50_ms'):.0f} | "
            f"{median(system, 'ttft_p99_ms'):.0f} | {1000 * median(system, 'seconds_per_token'):.1f} |"
        )
    print(f"\nserver overhead per token (http ÷ direct): {overhead:.3f}x")
    print(f"max concurrent decode observed: {stats.max_concurrent_decode}; lane switches {stats.switches}")
    load = os.getloadavg()
    print(f"Load average (1, 5 min) after the run: {load[0]:.2f}, {load[1]:.2f}\n")
    print(
        json.dumps(
            {
                "clients": args.clients,
                "max_tokens": args.max_tokens,
                "dtype": args.dtype,
                "repeats": args.repeats,
                "summary": {
                    system: {
                        key: median(system, key)
                        for key in ("requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "seconds_per_token")
                    }
                    for system in results
                },
                "overhead_per_token": overhead,
                "max_concurrent_decode": stats.max_concurrent_decode,
                "runs": results,
                "load_average": list(load[:2]),
            }
        )
    )


if __name__ == "__main__":
    main()
