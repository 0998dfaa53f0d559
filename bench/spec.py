"""Speculative decoding benchmark: polylane's drafters against plain decode and transformers.

Run:  python bench/spec.py [--pairs qwen,qwen-twin,smol-twin,smol-ngram] [--kinds code,chat,extraction]
      [--max-tokens 64] [--threads 2] [--repeats 1] [--no-transformers]

Pairs (targets in fp32, greedy, one request at a time):
- qwen: Qwen2.5-Coder-1.5B drafted by Qwen2.5-Coder-0.5B (identical tokenizers); transformers
  baseline: assisted generation with the same assistant, and prompt lookup.
- qwen-twin / smol-twin: the target drafted by its own int4 quantised twin (`runtime.model.quantize`);
  transformers has no such twin: its baselines are plain generate and prompt lookup.
- smol-ngram: SmolLM2-135M drafted by n-gram prompt lookup; transformers baseline: prompt lookup
  (`prompt_lookup_num_tokens=10`).
Prompt kinds: code (complete and extend a function), chat (free-form answer), extraction (copy
fields out of a given text).

Systems, each run on every prompt, alternated so drift hits them alike:
- polylane plain: the same driver with no speculator (`runtime.speculation.generate`, batch 1).
- polylane chain / tree / auto: a speculator whose controller may choose K or the tree size
  (mode "chain" or "tree"), or anything including off ("auto"). One speculator per pair and mode
  is kept across prompts, as a server would, so its statistics and cost model warm up.
- transformers plain, assisted (same pair) and prompt lookup (fp32, same GGUF file), run in a
  separate process after polylane's models are freed (memory).

Metrics:
- decode_tps: (generated tokens − 1) / (time of the last token − time of the first token): the
  decode phase only (prefill and TTFT excluded). speedup = decode_tps / the same engine's plain
  decode_tps on the same prompt; vs_hf_best = polylane's decode_tps / the best transformers
  decode_tps (plain, assisted or lookup) on the same prompt.
- acceptance: accepted draft tokens / proposed draft tokens; tokens_per_verify: tokens produced
  per verify pass that carried a draft (accepted + 1); rounds: such verify passes; plain_steps:
  decode steps the controller left plain.
- identical: speculative tokens == polylane plain tokens (greedy parity; must be true).
The last stdout line is one JSON document with every number.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import statistics
import sys
import time
from typing import Any

import torch

PAIRS = {
    "qwen": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
    "qwen-twin": ("qwen2.5-coder-1.5b-instruct", "twin:int4"),
    "smol-twin": ("smollm2-135m-instruct", "twin:int4"),
    "smol-ngram": ("smollm2-135m-instruct", "ngram"),
}
EXTRACTION_TEXT = (
    "Meeting notes, 14 March. Present: Alice Martin (alice.martin@example.com, Lyon office), "
    "Bruno Keller (b.keller@example.org, Zurich office), Chen Wei (chen.wei@example.net, Singapore "
    "office) and Dana Novak (dana.novak@example.com, Prague office). Alice Martin presented the Q1 "
    "budget of 48,500 EUR; Bruno Keller asked for 12,000 EUR more for the Zurich lab. Chen Wei will "
    "send the Singapore hiring plan by 21 March. Dana Novak closes the Prague lease on 30 April."
)
CODE_SNIPPET = (
    "def moving_average(values, window):\n"
    "    result = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        total = 0\n"
    "        for j in range(window):\n"
    "            total += values[i + j]\n"
    "        result.append(total / window)\n"
    "    return result\n"
)
MESSAGES = {
    "code": "Add type hints and a docstring to this Python function, and return the whole function:\n\n"
    + CODE_SNIPPET,
    "chat": "In a few sentences, why do cats purr, and what does it tell us about them?",
    "extraction": "From the notes below, list every person as 'Name | email | office', one per line.\n\n"
    + EXTRACTION_TEXT,
}


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prompt_ids(tokenizer: Any, kind: str) -> tuple[int, ...]:
    return tuple(tokenizer.render_chat([{"role": "user", "content": MESSAGES[kind]}]))


def _rate(tokens: int, seconds: float) -> float:
    return (tokens - 1) / seconds if tokens > 1 and seconds > 0 else 0.0


# ---------------------------------------------------------------------- polylane


def run_polylane(pair: str, kinds: list[str], max_tokens: int, repeats: int) -> dict[str, Any]:
    from polylane.policy.speculation.control import SpeculationConfig
    from polylane.runtime.generate import GenerationRequest
    from polylane.runtime.kv.model_kv import ModelKV
    from polylane.runtime.loading.loaded_model import load_model
    from polylane.runtime.speculation.drafters import ModelDrafter, NgramDrafter
    from polylane.runtime.speculation.generate import SpeculativeGenerator
    from polylane.runtime.speculation.speculator import Speculator
    from polylane.types import SamplingParams

    target_name, drafter_name = PAIRS[pair]
    drafter_model = None
    if drafter_name == "twin:int4":  # first: building it holds a float32 copy for a while
        progress(f"[{pair}] building the int4 twin …")
        drafter_model = load_model(target_name, "int4", quiet=True)
    progress(f"[{pair}] loading {target_name} (fp32) …")
    target = load_model(target_name, "fp32", quiet=True)
    if drafter_name not in ("ngram", "twin:int4"):
        progress(f"[{pair}] loading {drafter_name} (fp32) …")
        drafter_model = load_model(drafter_name, "fp32", quiet=True)
        assert drafter_model.tokenizer.digest == target.tokenizer.digest, "tokenizers differ"

    def speculator(mode: str) -> Speculator:
        spec = Speculator(target.name, SpeculationConfig(mode="auto" if mode == "auto" else mode))
        if drafter_model is None:
            spec.add_drafter(NgramDrafter(), 0.002)
        else:
            kv = ModelKV(drafter_model, num_blocks=128, block_size=16, prefix_cache=True)
            kind = "twin" if drafter_name.startswith("twin") else "model"
            relative = drafter_model.weight_bytes / target.weight_bytes
            spec.add_drafter(ModelDrafter(drafter_name, kind, kv, target.name, spec.monitor), relative)
        return spec

    modes = ["chain", "tree", "auto"]
    speculators = {mode: speculator(mode) for mode in modes}
    params = SamplingParams(max_tokens=max_tokens)
    results: dict[str, Any] = {}
    generator_kv = ModelKV(target, num_blocks=128, block_size=16, prefix_cache=False)
    warm = prompt_ids(target.tokenizer, "chat")[:16]
    SpeculativeGenerator(target, None, kv=generator_kv).generate([GenerationRequest(warm, params)])
    for kind in kinds:
        prompt = prompt_ids(target.tokenizer, kind)
        runs: dict[str, list[Any]] = {"plain": [], **{m: [] for m in modes}}
        for _ in range(repeats):
            for system in ["plain", *modes]:
                spec = None if system == "plain" else speculators[system]
                generator = SpeculativeGenerator(target, spec, kv=generator_kv)
                output = generator.generate([GenerationRequest(prompt, params)])[0]
                runs[system].append(output)
                progress(
                    f"[{pair}] {kind:10s} {system:6s} {len(output.token_ids)} tokens "
                    f"{_rate(len(output.token_ids), output.decode_seconds):6.2f} tok/s"
                )
        plain_tokens = runs["plain"][0].token_ids
        entry: dict[str, Any] = {"prompt_tokens": len(prompt)}
        for system, outputs in runs.items():
            rates = [_rate(len(o.token_ids), o.decode_seconds) for o in outputs]
            last = outputs[-1]
            entry[system] = {
                "tokens": len(last.token_ids),
                "decode_tps": statistics.median(rates),
                "identical": all(o.token_ids == plain_tokens for o in outputs),
                "rounds": sum(o.rounds for o in outputs),
                "plain_steps": sum(o.plain_steps for o in outputs),
                "drafted": sum(o.drafted for o in outputs),
                "accepted": sum(o.accepted for o in outputs),
            }
            e = entry[system]
            e["acceptance"] = e["accepted"] / e["drafted"] if e["drafted"] else None
            e["tokens_per_verify"] = (e["accepted"] + e["rounds"]) / e["rounds"] if e["rounds"] else None
            plain_rate = entry["plain"]["decode_tps"]
            e["speedup"] = e["decode_tps"] / plain_rate if plain_rate else None
        results[kind] = entry
    pair_stats = {}
    for mode, spec in speculators.items():
        for name, stats in spec.stats.items():
            pair_stats[mode] = {
                "drafter": name,
                "rounds": stats.rounds,
                "chain_rounds": stats.chain_rounds,
                "tree_rounds": stats.tree_rounds,
                "acceptance_rate": stats.acceptance_rate,
                "tokens_per_verify": stats.tokens_per_verify,
                "draft_cost_share": stats.draft_cost_share,
                "decisions_on": stats.decisions_on,
                "decisions_off": stats.decisions_off,
            }
        spec.close()
    speculators.clear()
    gc.collect()
    return {"target": target_name, "drafter": drafter_name, "prompts": results, "pairs": pair_stats}


# ---------------------------------------------------------------------- transformers


def _hf_worker(pair: str, kinds: list[str], max_tokens: int, repeats: int, threads: int, queue: Any) -> None:
    try:
        queue.put(run_transformers(pair, kinds, max_tokens, repeats, threads))
    except Exception as error:  # reported in the results, the benchmark goes on
        queue.put({"error": f"{type(error).__name__}: {error}"})


def run_transformers(
    pair: str, kinds: list[str], max_tokens: int, repeats: int, threads: int
) -> dict[str, Any]:
    from pathlib import Path

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from polylane import catalog
    from polylane.runtime.sampling.tokenizer import load_tokenizer

    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    def load(name: str) -> Any:
        source = catalog.resolve(name, quiet=True)
        file = Path(source.path)
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
        return model.eval(), load_tokenizer(source)

    target_name, drafter_name = PAIRS[pair]
    progress(f"[{pair}] transformers: loading {target_name} …")
    model, tokenizer = load(target_name)
    assistant = None
    if drafter_name not in ("ngram", "twin:int4"):
        progress(f"[{pair}] transformers: loading {drafter_name} …")
        assistant, _ = load(drafter_name)
    systems = ["plain", "lookup"] + (["assisted"] if assistant is not None else [])
    pad = min(tokenizer.stop_token_ids) if tokenizer.stop_token_ids else 0
    results: dict[str, Any] = {}
    for kind in kinds:
        prompt = torch.tensor([prompt_ids(tokenizer, kind)], dtype=torch.long)
        entry: dict[str, Any] = {}
        for system in systems:
            rates, tokens = [], []
            for _ in range(repeats):
                kwargs: dict[str, Any] = {
                    "max_new_tokens": max_tokens,
                    "do_sample": False,
                    "pad_token_id": pad,
                }
                kwargs.update(temperature=None, top_p=None, top_k=None)
                if system == "lookup":
                    kwargs["prompt_lookup_num_tokens"] = 10
                elif system == "assisted":
                    kwargs["assistant_model"] = assistant
                streamer = _Streamer()
                with torch.inference_mode():
                    output = model.generate(
                        input_ids=prompt, attention_mask=torch.ones_like(prompt), streamer=streamer, **kwargs
                    )
                generated = output[0, prompt.shape[1] :].tolist()
                count = next(
                    (i + 1 for i, t in enumerate(generated) if t in tokenizer.stop_token_ids), len(generated)
                )
                decode_seconds = streamer.time_of(count) - streamer.time_of(1)
                rates.append(_rate(count, decode_seconds))
                tokens.append(generated[:count])
                progress(
                    f"[{pair}] transformers {kind:10s} {system:8s} {count} tokens {rates[-1]:6.2f} tok/s"
                )
            entry[system] = {
                "tokens": len(tokens[-1]),
                "decode_tps": statistics.median(rates),
                "ids": tokens[-1],
            }
        results[kind] = entry
    return results


class _Streamer:
    """Times each generated position (assisted generation streams several tokens at once)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.arrivals: list[float] = []

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.perf_counter()
        self.arrivals.extend([now] * (value.shape[-1] if value.dim() > 1 else value.numel()))

    def end(self) -> None:
        pass

    def time_of(self, position: int) -> float:
        """Arrival time of generated token `position` (1-based)."""
        return self.arrivals[min(position, len(self.arrivals)) - 1]


# ---------------------------------------------------------------------- report


def _cell(entry: dict[str, Any], system: str) -> str:
    e = entry[system]
    mark = "" if e["identical"] else " ≠"
    return f"{e['decode_tps']:.2f} ({e['speedup']:.2f}×){mark}"


def _hf_cell(hf: dict[str, Any], system: str) -> str:
    return f"{hf[system]['decode_tps']:.2f}" if system in hf else "n/a"


def report(results: dict[str, Any]) -> None:
    print("\n## polylane speculative decode vs plain decode and transformers (decode tok/s, batch 1)\n")
    columns = ["pair", "prompt", "plain", "chain (×)", "tree (×)", "auto (×)", "HF plain", "HF assisted"]
    columns += ["HF lookup", "auto vs best HF"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for pair, data in results.items():
        for kind, entry in data["polylane"]["prompts"].items():
            hf = data.get("transformers", {}).get(kind, {})
            best_hf = max((v["decode_tps"] for v in hf.values()), default=0.0)
            versus = f"{entry['auto']['decode_tps'] / best_hf:.2f}×" if best_hf else "n/a"
            cells = [pair, kind, f"{entry['plain']['decode_tps']:.2f}"]
            cells += [_cell(entry, s) for s in ("chain", "tree", "auto")]
            cells += [_hf_cell(hf, s) for s in ("plain", "assisted", "lookup")] + [versus]
            print("| " + " | ".join(cells) + " |")
    print("\n## acceptance and tokens per verify (over all prompts of a pair)\n")
    columns = ["pair", "mode", "drafter", "rounds", "chain rounds", "tree rounds", "acceptance"]
    columns += ["tokens/verify", "draft cost share", "on / off"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for pair, data in results.items():
        for mode, s in data["polylane"]["pairs"].items():
            cells = [
                pair,
                mode,
                s["drafter"],
                str(s["rounds"]),
                str(s["chain_rounds"]),
                str(s["tree_rounds"]),
            ]
            cells += [f"{s['acceptance_rate']:.2f}", f"{s['tokens_per_verify']:.2f}"]
            cells += [f"{s['draft_cost_share']:.2f}", f"{s['decisions_on']} / {s['decisions_off']}"]
            print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default="qwen,qwen-twin,smol-twin,smol-ngram")
    parser.add_argument("--kinds", default="code,chat,extraction")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kinds = args.kinds.split(",")
    results: dict[str, Any] = {}
    started = time.perf_counter()
    hf_by_target: dict[str, Any] = {}  # transformers runs once per target (plain, lookup, assisted)
    for pair in args.pairs.split(","):
        results[pair] = {"polylane": run_polylane(pair, kinds, args.max_tokens, args.repeats)}
        target = PAIRS[pair][0]
        if target in hf_by_target:
            results[pair]["transformers"] = hf_by_target[target]
        elif not args.no_transformers:
            context = multiprocessing.get_context("spawn")
            queue = context.Queue()
            worker = context.Process(
                target=_hf_worker, args=(pair, kinds, args.max_tokens, args.repeats, args.threads, queue)
            )
            worker.start()
            hf = queue.get()
            worker.join()
            if "error" in hf:
                progress(f"[{pair}] transformers failed: {hf['error']}")
            else:
                for entry in hf.values():
                    plain_ids = None
                    for system in entry.values():
                        plain_ids = plain_ids or system["ids"]
                        system["matches_hf_plain"] = system.pop("ids") == plain_ids
                results[pair]["transformers"] = hf_by_target[target] = hf
    report(results)
    summary = {
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "seconds": time.perf_counter() - started,
        "results": results,
    }
    print(json.dumps(summary, default=float))


if __name__ == "__main__":
    main()
