"""Cross-model prefill share benchmark: a consumer's TTFT on a prompt a provider prefilled, vs cold.

Run:  python bench/layer_share.py [--model smollm2-135m-instruct] [--top-layers 15]
      [--prompt-tokens 2000] [--threads 2] [--repeats 5]

The provider is `--model` (fp32); the consumer is its sibling with the top `--top-layers` layers
perturbed (`polylane models sibling`, written once under the cache), so the two share layers
[0, num_layers - top_layers); the alias is the same file loaded a second time under another name
(it shares every layer). Each repeat uses a new prompt and fresh KV caches, and runs, alternating
the order of each measured system and its baseline so that machine drift cancels:

1. the provider prefills the prompt (a completed request: its KV enters its prefix tree);
2. consumer, shared: `LayerShare.open` imports the provider's cached whole blocks (K/V of the
   shared layers copied, the layers above computed from the stored boundary state), then one
   forward prefills the rest of the prompt (at least its last token) and yields the first token;
3. consumer, cold: the consumer alone, no prefix cache, one forward over the whole prompt;
4. alias, shared and cold: the same with the alias (the whole prefix is copied, nothing computed).

With --engine, the same through `Engine` (the serving path: scheduler, runner, `LayerShare.open`
in the runner): the three models registered in one engine (`max_step_tokens` above the prompt, so
no path is chunked), TTFT = submit → first token of a greedy request (`Completion.ttft_seconds`);
"cold" is the consumer on another prompt of the same length that no model has seen.

Metrics (median over --repeats, best in brackets):
- ttft_*_ms: prompt in → first token's logits out, as above (model loading excluded).
- speedup = cold / shared; ideal = num_layers / (num_layers - band) for the sibling (2.0 for half
  the layers shared), and "the whole prefill skipped" for the alias.
- imported_tokens: prompt tokens reused from the provider (whole blocks of all but the last).
- max_abs_logit_diff: shared vs cold first-token logits (float32); first_token_same: greedy
  first tokens agree.
The last stdout line is one JSON document with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

from polylane.runtime.kv.model_kv import Extend, ModelKV
from polylane.runtime.loading.loaded_model import load_model
from polylane.runtime.residency.siblings import SiblingSpec, ensure_sibling
from polylane.runtime.sharing.layer_share import LayerShare

BLOCK = 16


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_prompt(tokenizer: Any, tokens: int, variant: int) -> tuple[int, ...]:
    topics = ["rivers", "bridges", "violins", "glaciers", "printing", "orbits", "bees", "tides"]
    text = " ".join(
        f"Note {variant}.{i}: the {topics[(i + variant) % len(topics)]} chapter lists "
        f"{(i * 7 + variant) % 53} facts about them."
        for i in range(tokens // 8)
    )
    prompt = tuple(tokenizer.encode(text))[:tokens]
    assert len(prompt) == tokens, f"prompt text too short: {len(prompt)} tokens"
    return prompt


def prefill(kv: ModelKV, prompt: tuple[int, ...], share: LayerShare | None = None, name: str = "") -> Any:
    """Open (through `share` when given), prefill the rest in one forward; (logits, seconds,
    sequence)."""
    started = time.perf_counter()
    sequence = share.open(name, kv, prompt) if share is not None else kv.open(prompt)
    logits = kv.forward([Extend(sequence, prompt[sequence.num_tokens :])])[0]
    int(logits.argmax())
    return logits, time.perf_counter() - started, sequence


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = load_model(args.model, "fp32", quiet=True)
    alias = load_model(args.model, "fp32", quiet=True)  # the same file under a second name
    sibling_path = ensure_sibling(args.model, SiblingSpec(top_layers=args.top_layers, seed=1))
    sibling = load_model(str(sibling_path), "fp32", quiet=True)
    blocks = args.prompt_tokens // BLOCK + 8
    names = {"provider": base, "consumer": sibling, "alias": alias}
    times: dict[str, list[float]] = {
        key: [] for key in ("consumer_shared", "consumer_cold", "alias_shared", "alias_cold")
    }
    provider_ms, imported, diffs, same = (
        [],
        {"consumer": 0, "alias": 0},
        {"consumer": 0.0, "alias": 0.0},
        True,
    )
    band = 0
    for repeat in range(args.repeats):
        prompt = make_prompt(base.tokenizer, args.prompt_tokens, repeat)
        share = LayerShare()
        kvs = {name: ModelKV(model, num_blocks=blocks, block_size=BLOCK) for name, model in names.items()}
        for name, kv in kvs.items():
            share.attach(name, kv)
        band = share.band("provider", "consumer").layers
        _, seconds, sequence = prefill(kvs["provider"], prompt, share, "provider")
        kvs["provider"].close(sequence)
        provider_ms.append(seconds * 1000)
        for who in ("consumer", "alias"):
            cold_kv = ModelKV(names[who], num_blocks=blocks, block_size=BLOCK, prefix_cache=False)
            order = ("shared", "cold") if repeat % 2 == 0 else ("cold", "shared")
            logits = {}
            for kind in order:
                if kind == "shared":
                    logits[kind], seconds, sequence = prefill(kvs[who], prompt, share, who)
                    kvs[who].close(sequence, cache=False)
                else:
                    logits[kind], seconds, sequence = prefill(cold_kv, prompt)
                    cold_kv.close(sequence, cache=False)
                times[f"{who}_{kind}"].append(seconds * 1000)
            imported[who] = share.stats()[who].imported_tokens
            diffs[who] = max(diffs[who], (logits["shared"] - logits["cold"]).abs().max().item())
            same &= int(logits["shared"].argmax()) == int(logits["cold"].argmax())
        progress(
            f"  repeat {repeat + 1}/{args.repeats}: provider {provider_ms[-1]:.0f} ms; "
            + ", ".join(f"{key} {values[-1]:.0f} ms" for key, values in times.items())
        )
    median = {key: statistics.median(values) for key, values in times.items()}
    num_layers = base.config.num_layers
    return {
        "model": base.name,
        "sibling": str(sibling_path),
        "num_layers": num_layers,
        "band": band,
        "prompt_tokens": args.prompt_tokens,
        "imported_tokens": imported,
        "provider_prefill_ms": statistics.median(provider_ms),
        **{f"ttft_{key}_ms": value for key, value in median.items()},
        **{f"ttft_{key}_ms_best": min(values) for key, values in times.items()},
        "consumer_speedup": median["consumer_cold"] / median["consumer_shared"],
        "consumer_ideal_speedup": num_layers / (num_layers - band),
        "alias_speedup": median["alias_cold"] / median["alias_shared"],
        "max_abs_logit_diff": diffs,
        "first_token_same": same,
    }


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    from polylane.engine import Engine, EngineConfig
    from polylane.policy.scheduling.scheduler import SchedulerConfig
    from polylane.types import SamplingParams

    sibling_path = ensure_sibling(args.model, SiblingSpec(top_layers=args.top_layers, seed=1))
    config = EngineConfig(
        budget_bytes=8 << 30, scheduler=SchedulerConfig(max_step_tokens=args.prompt_tokens + 64)
    )
    times: dict[str, list[float]] = {
        key: [] for key in ("consumer_shared", "consumer_cold", "alias_shared", "alias_cold")
    }
    one = SamplingParams(max_tokens=1)
    with Engine(config) as engine:
        kv_tokens = 4 * (args.prompt_tokens + 64)
        engine.add_model("provider", args.model, kv_tokens=kv_tokens)
        engine.add_model("consumer", str(sibling_path), kv_tokens=kv_tokens)
        engine.add_model("alias", args.model, kv_tokens=kv_tokens)
        tokenizer = engine.models["provider"].tokenizer
        for name in ("provider", "consumer", "alias"):  # load, and warm up each model's first forward
            engine.generate(name, list(make_prompt(tokenizer, 64, 10_000)), one)
        for repeat in range(args.repeats):
            prompt = list(make_prompt(tokenizer, args.prompt_tokens, repeat))
            engine.generate("provider", prompt, one)
            for who in ("consumer", "alias"):
                unseen = list(
                    make_prompt(tokenizer, args.prompt_tokens, 1000 + 2 * repeat + (who == "alias"))
                )
                order = ("shared", "cold") if repeat % 2 == 0 else ("cold", "shared")
                for kind in order:
                    completion = engine.generate(who, prompt if kind == "shared" else unseen, one)
                    times[f"{who}_{kind}"].append((completion.ttft_seconds or 0.0) * 1000)
            progress(
                f"  engine repeat {repeat + 1}/{args.repeats}: "
                + ", ".join(f"{key} {values[-1]:.0f} ms" for key, values in times.items())
            )
        stats = engine.stats().models
    median = {key: statistics.median(values) for key, values in times.items()}
    return {
        **{f"engine_ttft_{key}_ms": value for key, value in median.items()},
        "engine_consumer_speedup": median["consumer_cold"] / median["consumer_shared"],
        "engine_alias_speedup": median["alias_cold"] / median["alias_shared"],
        "engine_cross_model_tokens": {who: stats[who].cross_model_tokens for who in ("consumer", "alias")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--top-layers", type=int, default=15, help="layers the sibling changes")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine", action="store_true", help="also measure through the engine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    progress(f"{args.model} fp32, {args.threads} threads, {args.repeats} repeats")
    result = run(args)
    if args.engine:
        result.update(run_engine(args))
    print(
        f"\n## {result['model']} fp32 and its sibling sharing layers [0, {result['band']}) of "
        f"{result['num_layers']}, {args.prompt_tokens}-token prompt, {args.threads} threads "
        f"(median of {args.repeats}; best)\n"
    )
    print("| consumer | shared prefill (ms) | cold prefill (ms) | speedup | ideal | tokens imported |")
    print("|---|---:|---:|---:|---:|---:|")
    print(
        f"| sibling (band {result['band']}/{result['num_layers']}) | {result['ttft_consumer_shared_ms']:.0f} "
        f"({result['ttft_consumer_shared_ms_best']:.0f}) | {result['ttft_consumer_cold_ms']:.0f} "
        f"({result['ttft_consumer_cold_ms_best']:.0f}) | {result['consumer_speedup']:.2f}x | "
        f"{result['consumer_ideal_speedup']:.2f}x | {result['imported_tokens']['consumer']} |"
    )
    print(
        f"| alias (every layer) | {result['ttft_alias_shared_ms']:.0f} "
        f"({result['ttft_alias_shared_ms_best']:.0f}) | "
        f"{result['ttft_alias_cold_ms']:.0f} ({result['ttft_alias_cold_ms_best']:.0f}) | "
        f"{result['alias_speedup']:.2f}x | whole prefill skipped | {result['imported_tokens']['alias']} |"
    )
    diffs = result["max_abs_logit_diff"]
    print(
        f"\nProvider's own prefill: {result['provider_prefill_ms']:.0f} ms. Shared vs cold: first token "
        f"identical: {result['first_token_same']}; max-abs logit difference: sibling "
        f"{diffs['consumer']:.2e}, alias {diffs['alias']:.2e}.\n"
    )
    if args.engine:
        e = {key.removeprefix("engine_"): value for key, value in result.items() if key.startswith("engine_")}
        print(
            f"Through the engine (submit → first token): sibling {e['ttft_consumer_shared_ms']:.0f} ms "
            f"shared vs {e['ttft_consumer_cold_ms']:.0f} ms cold ({e['consumer_speedup']:.2f}x); "
            f"alias {e['ttft_alias_shared_ms']:.0f} vs {e['ttft_alias_cold_ms']:.0f} ms "
            f"({e['alias_speedup']:.2f}x); cross-model tokens {e['cross_model_tokens']}.\n"
        )
    load = list(os.getloadavg())
    print(f"Load average (1, 5 min) after the run: {load[0]:.2f}, {load[1]:.2f}\n")
    print(json.dumps({"threads": args.threads, "repeats": args.repeats, "load_average": load[:2], **result}))


if __name__ == "__main__":
    main()
