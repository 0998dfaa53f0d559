"""`polylane bench WORKLOAD`: the command line of the harness.

What this module owns: the `bench` subcommand's arguments, turning them into a `BenchConfig`,
and the output: results.json, results.md and the plots under --out, the Markdown table on stdout,
and, as the last line of stdout, one JSON document with the headline numbers and ratios. Progress
goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from polylane import catalog
from polylane.bench.systems import BASELINES, DEFAULT_BASELINES, SPEC_MODES, VARIANT_PREFIX, with_mode
from polylane.bench.workloads import DEFAULTS, PROMPT_CATEGORIES, SPEC_CATEGORIES, WORKLOADS
from polylane.policy.scheduling.lane import LANE_POLICIES
from polylane.types import DEFAULT_DTYPE, WEIGHT_DTYPES

SMALL_MODELS = ("smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct")
DEFAULT_MODELS = {
    "single": (catalog.DEFAULT_MODEL,),
    "mix": SMALL_MODELS,
    "shared-prefix": (catalog.DEFAULT_MODEL,),
    "spec": (catalog.DEFAULT_MODEL,),
    "structured": (catalog.DEFAULT_MODEL,),
    # the provider, its sibling sharing layers [0, 15) of SmolLM2's 30, and an alias (every layer)
    "cross-model": (catalog.DEFAULT_MODEL, "sibling=sibling:15", f"alias={catalog.DEFAULT_MODEL}"),
}
CROSS_MODEL_PROMPT_TOKENS = 2000


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    defaults = "; ".join(
        f"{w}: {d['requests']} requests, {d['max_tokens']} tokens, concurrency {d['concurrency']}, "
        f"rate {d['rate']}/s, baselines {' '.join(DEFAULT_BASELINES.get(w, ('plain',)))}"
        for w, d in DEFAULTS.items()
    )
    bench = commands.add_parser(
        "bench",
        help="measure polylane against its baselines on a workload (JSON, Markdown, plots)",
        description="Run a seeded workload on polylane and its baselines, alternating every repeat; "
        "metrics are defined in polylane/bench/metrics.py. Defaults per workload: " + defaults,
    )
    bench.add_argument("workload", choices=WORKLOADS, help="what to run (see polylane/bench/workloads.py)")
    bench.add_argument(
        "--models",
        nargs="+",
        help="catalogue names or paths, or NAME=SOURCE to serve one file under another name; SOURCE "
        "sibling:N is the first model's sibling with its top N layers changed (written once under "
        f"the cache). Default: {catalog.DEFAULT_MODEL}; mix: the three small models; spec: the target "
        "first, then models that only draft for it; shared-prefix --cross-model: the provider first, "
        f"then its consumers (default {' '.join(DEFAULT_MODELS['cross-model'])})",
    )
    bench.add_argument(
        "--baseline",
        nargs="+",
        choices=[*BASELINES, "none"],
        help="baselines run in the same invocation (default per workload; none: polylane alone)",
    )
    bench.add_argument("--out", help="output folder (default bench/out/WORKLOAD)")
    bench.add_argument("--url", help="measure the server at this address (through the openai client)")
    bench.add_argument("--api-key", help="the server's API key ($POLYLANE_API_KEY)")
    bench.add_argument("--seed", type=int, default=0, help="same seed, same requests")
    bench.add_argument("--requests", type=int, help="requests per phase (single, spec) or in all")
    bench.add_argument(
        "--max-tokens", type=int, help="output tokens per request (mix, shared-prefix: at most)"
    )
    bench.add_argument("--repeats", type=int, default=3, help="runs of every system, alternating order")
    bench.add_argument("--concurrency", type=int, help="most requests in flight (0: no cap)")
    bench.add_argument("--rate", type=float, help="Poisson arrivals per second (0: all at once)")
    bench.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of model popularity")
    bench.add_argument(
        "--prompt-tokens",
        type=int,
        help=f"single: prefill prompt length (512); shared-prefix --cross-model: the shared prompt's "
        f"({CROSS_MODEL_PROMPT_TOKENS})",
    )
    bench.add_argument("--batch", type=int, default=8, help="single: streams of the batch phase")
    bench.add_argument("--prefixes", type=int, default=3, help="shared-prefix: distinct system prompts")
    bench.add_argument(
        "--cross-model",
        action="store_true",
        help="shared-prefix: the prefill shared across models: the first model prefills each prompt, "
        "then every other model (a sibling or an alias) gets it and an unseen one",
    )
    bench.add_argument(
        "--categories",
        nargs="+",
        choices=PROMPT_CATEGORIES,
        help=f"spec: prompt categories, one phase each (default {' '.join(SPEC_CATEGORIES)})",
    )
    bench.add_argument(
        "--speculation",
        nargs="+",
        metavar="DRAFTER",
        help="polylane's speculation for the first model, as Engine.add_model takes it: drafters "
        "(ngram, twin, twin:int8, a served model's name, auto), true, off, or one JSON object of "
        'SpeculationConfig fields, e.g. \'{"drafters": ["ngram"], "shape": "chain:4", '
        '"adaptive": false}\' (default: spec auto, every other workload off)',
    )
    bench.add_argument(
        "--spec-mode",
        nargs="+",
        choices=SPEC_MODES,
        help="speculation mode of polylane (the first), and of one more system per further mode "
        "(polylane-chain, polylane-tree, …) run beside it in the same invocation",
    )
    bench.add_argument(
        "--dtype",
        default=DEFAULT_DTYPE,
        choices=WEIGHT_DTYPES,
        help="weight dtype, every system (transformers runs int8/int4 at bf16: it has no such CPU kernels)",
    )
    bench.add_argument(
        "--threads",
        type=int,
        default=0,
        help="compute threads per process (0: polylane adapts to the machine's load, the others take "
        "torch's default)",
    )
    bench.add_argument(
        "--cpu-hog",
        type=int,
        default=0,
        metavar="N",
        help="run every phase twice, idle and while N busy-loop processes keep cores busy (started "
        "and stopped by the bench), and report how much of its idle speed each system keeps",
    )
    bench.add_argument("--budget", default="64GiB", help="polylane's memory budget (bytes, 6GiB, auto)")
    bench.add_argument(
        "--device",
        default="auto",
        help="where polylane runs: auto (CUDA when torch sees a GPU, else CPU), cpu, cuda, cuda:N",
    )
    bench.add_argument(
        "--kv-tokens",
        type=int,
        help="KV cache tokens per model (default 2048; shared-prefix --cross-model: 4 × (prompt + 64))",
    )
    bench.add_argument("--lane-policy", default="throughput", choices=list(LANE_POLICIES))
    bench.add_argument(
        "--drafter",
        help="transformers-assisted: the assistant model (default: polylane's drafter model when "
        "--speculation names one or is auto with a second model, else prompt lookup)",
    )
    bench.add_argument("--timeout", type=float, default=3600, help="seconds one phase run may take")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument(
        "--rebuild",
        action="store_true",
        help="measure nothing: recompute the medians and ratios of OUT/results.json and rewrite the report",
    )
    bench.set_defaults(run=run, _bench_parser=bench)


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run: the workload and every option not at its default."""
    words = ["polylane", "bench", args.workload]
    for action in args._bench_parser._actions:
        if not action.option_strings or action.dest in (
            "help",
            "api_key",
            "no_progress",
            "rebuild",
        ):  # never a secret
            continue
        value = getattr(args, action.dest, None)
        if value is None or value == action.default or value is False:
            continue
        words.append(action.option_strings[0])
        if value is not True:
            words += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return shlex.join(words)


def _models(specs: list[str]) -> tuple[tuple[str, str], ...]:
    models = []
    for spec in specs:
        name, _, source = spec.partition("=")
        models.append((name, source) if source else (spec, spec))
    names = [n for n, _ in models]
    if len(set(names)) != len(names):
        raise ValueError(f"--models: a name is given twice in {names} (use NAME=SOURCE)")
    return tuple(models)


def run(args: argparse.Namespace) -> int:
    from polylane.bench import harness
    from polylane.bench.systems import SystemSettings
    from polylane.bench.workloads import WorkloadOptions
    from polylane.runtime.model.device import free_memory_bytes, resolve_device
    from polylane.server.config import parse_size

    out = Path(args.out or Path("bench") / "out" / args.workload)
    if args.rebuild:
        results = harness.rebuild(json.loads((out / "results.json").read_text()))
        return _write(results, out)
    device = resolve_device(args.device)  # a device that is not there fails before any system starts
    cross_model = bool(args.cross_model)
    if cross_model and args.workload != "shared-prefix":
        raise ValueError("--cross-model is a mode of the shared-prefix workload")
    default_models = DEFAULT_MODELS["cross-model" if cross_model else args.workload]
    models = _models(args.models or list(default_models))
    speculation = speculation_setting(args.speculation, args.spec_mode, args.workload)
    drafter = args.drafter
    if drafter is None and speculation is not None:
        drafter = assistant_source(models, speculation)
    elif drafter is not None:
        drafter = dict(models).get(drafter, drafter)  # a served name: its source
    baselines = tuple(args.baseline or default_baselines(args.workload, drafter))
    if "none" in baselines:
        baselines = ()
    variants = tuple(f"{VARIANT_PREFIX}{mode}" for mode in dict.fromkeys((args.spec_mode or [])[1:]))
    prompt_tokens = args.prompt_tokens or (CROSS_MODEL_PROMPT_TOKENS if cross_model else 512)
    kv_tokens = args.kv_tokens or (max(2048, 4 * (prompt_tokens + 64)) if cross_model else 2048)
    options = WorkloadOptions(
        models=tuple(n for n, _ in models),
        seed=args.seed,
        requests=args.requests,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        rate=args.rate,
        zipf_s=args.zipf,
        prompt_tokens=prompt_tokens,
        batch=args.batch,
        prefixes=args.prefixes,
        categories=tuple(args.categories or SPEC_CATEGORIES),
        cross_model=cross_model,
        cpu_hog=args.cpu_hog,
    )
    settings = SystemSettings(
        models=models,
        dtype=args.dtype,
        budget_bytes=parse_size(args.budget, lambda: free_memory_bytes(device)),
        device=str(device),
        kv_tokens=kv_tokens,
        lane_policy=args.lane_policy,
        threads=args.threads,
        drafter=drafter,
        speculation=speculation,
        # spec: every request goes to the target; the other models only draft for it
        baseline_models=models[:1] if args.workload == "spec" else None,
    )
    config = harness.BenchConfig(
        workload=args.workload,
        options=options,
        settings=settings,
        baselines=baselines,
        repeats=args.repeats,
        url=args.url,
        api_key=args.api_key or os.environ.get("POLYLANE_API_KEY") or None,
        progress=not args.no_progress,
        timeout_s=args.timeout,
        command=command_line(args),
        variants=variants,
    )
    return _write(harness.run(config), out)


def speculation_setting(words: list[str] | None, modes: list[str] | None, workload: str) -> Any:
    """polylane's speculation for the first model from --speculation and --spec-mode, as
    `Engine.add_model(speculation=...)` takes it (JSON-able), checked; None: no speculation."""
    from polylane.policy.speculation.control import SpeculationConfig

    value: Any
    if not words:
        value = True if workload in ("spec", "structured") else None
    elif len(words) == 1 and words[0].lstrip().startswith("{"):
        value = json.loads(words[0])
    elif len(words) == 1 and words[0].lower() in ("true", "on", "yes"):
        value = True
    elif len(words) == 1 and words[0].lower() in ("false", "off", "no", "none"):
        value = None
    else:
        value = list(words)
    if modes:
        if value is None:
            raise ValueError("--spec-mode needs speculation (--speculation)")
        value = with_mode(value, modes[0])
    SpeculationConfig.parse(value)  # raises on a bad setting, here rather than in a worker
    return value


def assistant_source(models: tuple[tuple[str, str], ...], speculation: Any) -> str | None:
    """The source of polylane's drafter model for the target (the first model), for transformers'
    assisted generation: the first served model the speculation names, or with "auto" the second
    model given; None when polylane drafts with no other model (n-gram, twin)."""
    from polylane.policy.speculation.control import AUTO, SpeculationConfig

    config = SpeculationConfig.parse(speculation)
    if config is None:
        return None
    sources = dict(models[1:])
    for drafter in config.drafters:
        if drafter in sources:
            return sources[drafter]
        if drafter == AUTO and sources:
            return next(iter(sources.values()))
    return None


def default_baselines(workload: str, drafter: str | None) -> tuple[str, ...]:
    """The workload's default baselines; in spec, transformers-assisted only with a drafter model
    (without one it would be prompt lookup again)."""
    baselines = DEFAULT_BASELINES[workload]
    if workload == "spec" and drafter is None:
        baselines = tuple(b for b in baselines if b != "transformers-assisted")
    return baselines


def _write(results: dict[str, Any], out: Path) -> int:
    from polylane.bench import report

    paths = report.write(results, out)
    print(paths["markdown"].read_text())
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    print(report.final_line(results, out), flush=True)
    return 0
