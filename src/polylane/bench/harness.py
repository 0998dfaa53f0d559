"""One bench invocation: build the workload, run every system in alternating order, summarise.

What this module owns: the procedure. For each repeat r the workload is built for (seed, r); the
systems then take turns, polylane first (then its mode variants) and the baselines after it on
even repeats, the reverse order on odd ones, so that drift of a shared machine falls on every
system alike. Each system is opened (loaded, warmed up) just before its turn and closed after it.
Every phase run is summarised (`metrics.summarise`); the medians over repeats and the ratios of
polylane to every other system make up the results, which `report` writes, with two derived
blocks: `speculation` (per phase and speculating system: acceptance, tokens per verify, shapes,
decisions, and the decode speedup over every non-speculating system) and, in the cross-model
shared-prefix workload, `cross_model` (per consumer and system: TTFT on a prompt the provider
prefilled vs on an unseen one, and the tokens imported). A progress bar (stderr) counts requests.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from polylane.bench import metrics, workloads
from polylane.bench.cpu_hog import busy_loops
from polylane.bench.systems import BASELINES, SYSTEMS, VARIANTS, SystemSettings, make_system

SCHEMA_ID = "polylane-bench/1"

# The number that says the most about each kind of phase (the plots' bars and the headline).
PRIMARY_METRIC = {
    "prefill": "prefill_tokens_per_s",
    "decode": "stream_decode_tokens_per_s",
    "batch": "aggregate_decode_tokens_per_s",
    "drafting-pays": "stream_decode_tokens_per_s",
    "drafting-does-not-pay": "stream_decode_tokens_per_s",
}


def primary_metric(phase: str, workload: str = "", cross_model: bool = False) -> str:
    """The key of the phase's primary metric: its own for the single phases, decode tokens/s per
    stream in spec, TTFT p50 in the cross-model shared-prefix workload, throughput for the rest."""
    if workload in ("spec", "structured"):
        return "stream_decode_tokens_per_s"
    if cross_model:
        return "ttft_p50_s"
    phase = workloads.idle_phase_name(phase)
    key = "batch" if phase.startswith("batch-") else phase
    return PRIMARY_METRIC.get(key, "throughput_tokens_per_s")


@dataclass(frozen=True)
class BenchConfig:
    workload: str
    options: workloads.WorkloadOptions
    settings: SystemSettings
    baselines: tuple[str, ...]
    repeats: int = 1
    url: str | None = None
    api_key: str | None = None
    progress: bool = True
    timeout_s: float = 3600.0  # the most one phase run of one system may take
    command: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    variants: tuple[str, ...] = ()  # polylane-<mode> systems run beside polylane

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        for name in self.baselines:
            if name not in BASELINES:
                raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
        for name in self.variants:
            if name not in VARIANTS:
                raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        if self.variants and self.url:
            raise ValueError("mode variants run local engines; they cannot be measured with --url")

    @property
    def systems(self) -> list[str]:
        return ["polylane", *self.variants, *self.baselines]


def run(config: BenchConfig) -> dict[str, Any]:
    """Run the bench; the results document (see `schema.json`)."""
    from tqdm import tqdm

    names = config.systems
    systems = {
        name: make_system(name, config.settings, config.url, config.api_key, config.timeout_s)
        for name in names
    }
    built = [workloads.build(config.workload, config.options, r) for r in range(config.repeats)]
    total = sum(len(p.requests) for w in built for p in w.phases) * len(names)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    last_timelines: dict[str, dict[str, list[dict[str, Any]]]] = {name: {} for name in names}
    load_before = _load_average()
    git = _git()  # the code the workers start from (others may change the tree during a long run)
    bar = tqdm(total=total, unit="req", file=sys.stderr, disable=not config.progress, dynamic_ncols=True)
    try:
        for repeat, workload in enumerate(built):
            order = names if repeat % 2 == 0 else names[::-1]
            for position, name in enumerate(order):
                system = systems[name]
                bar.set_description(f"repeat {repeat + 1}/{config.repeats} {name}: loading")
                load_seconds = system.open()
                try:
                    phases: dict[str, Any] = {}
                    for phase in workload.phases:
                        bar.set_description(f"repeat {repeat + 1}/{config.repeats} {name}: {phase.name}")
                        with busy_loops(phase.cpu_hog):
                            result = system.run(phase, lambda: bar.update(1))
                        phases[phase.name] = metrics.summarise(result.timelines, result.engine)
                        last_timelines[name][phase.name] = [t.to_dict() for t in result.timelines]
                finally:
                    system.close()
                runs[name].append(
                    {"repeat": repeat, "position": position, "load_seconds": load_seconds, "phases": phases}
                )
    finally:
        bar.close()
    load_after = _load_average()
    results = assemble(config, built[0], runs, last_timelines, systems, (load_before, load_after))
    results["environment"]["git"] = git
    return results


def assemble(
    config: BenchConfig,
    workload: workloads.Workload,
    runs: dict[str, list[dict[str, Any]]],
    timelines: dict[str, dict[str, list[dict[str, Any]]]],
    systems: dict[str, Any],
    load_average: tuple[list[float], list[float]],
) -> dict[str, Any]:
    """The results document from every run's phase summaries."""
    phase_names = [p.name for p in workload.phases]
    summary, ratio, paired = summaries(runs, phase_names)
    out_systems: dict[str, Any] = {}
    for name, system_runs in runs.items():
        out_systems[name] = {
            "role": "system" if name == "polylane" else "variant" if name in VARIANTS else "baseline",
            "description": SYSTEMS[name]
            if not (name == "polylane" and config.url)
            else f"the server at {config.url}",
            "transport": systems[name].transport,
            "runs": system_runs,
            "summary": summary[name],
            "ratio": ratio[name],
            "paired_ratio": paired[name],
        }
    options = workload.options
    document: dict[str, Any] = {
        "schema": SCHEMA_ID,
        "workload": config.workload,
        "command": config.command,
        "created_utc": datetime.datetime.now(tz=datetime.UTC).isoformat(timespec="seconds"),
        "settings": {
            "models": [{"name": n, "source": s} for n, s in config.settings.models],
            "seed": options.seed,
            "requests": options.requests,
            "max_tokens": options.max_tokens,
            "concurrency": options.concurrency,
            "rate": options.rate,
            "zipf_s": options.zipf_s,
            "prompt_tokens": options.prompt_tokens,
            "batch": options.batch,
            "prefixes": options.prefixes,
            "repeats": config.repeats,
            "dtype": config.settings.dtype,
            "threads": config.settings.threads,
            "device": config.settings.device,
            "budget_bytes": config.settings.budget_bytes,
            "kv_tokens": config.settings.kv_tokens,
            "lane_policy": config.settings.lane_policy,
            "drafter": config.settings.drafter,
            "speculation": config.settings.speculation,
            "categories": list(options.categories),
            "cross_model": options.cross_model,
            "cpu_hog": options.cpu_hog,
            "url": config.url,
            "baselines": list(config.baselines),
            "variants": list(config.variants),
            "statistic": "median over repeats",
            **config.extra,
        },
        "environment": environment(load_average),
        "phases": [
            {**d, "primary_metric": primary_metric(d["name"], config.workload, options.cross_model)}
            for d in workloads.describe(workload)
        ],
        "systems": out_systems,
        "speculation": speculation(summary, phase_names, runs),
        "timelines": timelines,
    }
    if options.cross_model:
        document["cross_model"] = cross_model(summary, phase_names)
    if options.cpu_hog:
        document["cpu_hog"] = cpu_hog(summary, phase_names, config.workload)
    return document


def summaries(
    runs: dict[str, list[dict[str, Any]]], phase_names: Sequence[str]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Per system: the median summary of each phase, and (baselines only, else None) polylane's
    ratios to it of the medians and paired by repeat."""
    summary = {
        name: {
            phase: metrics.median_summary([r["phases"][phase] for r in system_runs]) for phase in phase_names
        }
        for name, system_runs in runs.items()
    }
    ratio: dict[str, Any] = {name: None for name in runs}
    paired: dict[str, Any] = {name: None for name in runs}
    for name, system_runs in runs.items():
        if name == "polylane":
            continue
        ratio[name] = {
            phase: metrics.ratios(summary["polylane"][phase], summary[name][phase]) for phase in phase_names
        }
        paired[name] = {
            phase: metrics.paired_ratios(
                [r["phases"][phase] for r in runs["polylane"]], [r["phases"][phase] for r in system_runs]
            )
            for phase in phase_names
        }
    return summary, ratio, paired


def rebuild(results: dict[str, Any]) -> dict[str, Any]:
    """A results document with its medians, ratios and speculation block computed again from its
    runs (after the summary code changed; nothing is measured)."""
    phase_names = [p["name"] for p in results["phases"]]
    runs = {name: system["runs"] for name, system in results["systems"].items()}
    summary, ratio, paired = summaries(runs, phase_names)
    for name, system in results["systems"].items():
        system.update(summary=summary[name], ratio=ratio[name], paired_ratio=paired[name])
    results["speculation"] = speculation(summary, phase_names, runs)
    if results["settings"].get("cross_model"):
        results["cross_model"] = cross_model(summary, phase_names)
    if results["settings"].get("cpu_hog"):
        results["cpu_hog"] = cpu_hog(summary, phase_names, results["workload"])
    return results


SPEC_KEYS = (
    "acceptance_rate",
    "tokens_per_verify",
    "drafted_tokens",
    "verify_steps",
    "chain_rounds",
    "tree_rounds",
    "decisions_on",
    "decisions_off",
)


def speculation(
    summary: dict[str, Any], phases: Sequence[str], runs: dict[str, list[dict[str, Any]]] | None = None
) -> dict[str, Any]:
    """Per phase: polylane's acceptance rate and tokens per verify (None where the engine reports
    no speculation) and its wall-clock decode speedup over every other system (stream decode
    tokens/s); under `systems`, the same for polylane and each mode variant, with verify passes,
    chain / tree rounds and on/off decisions, the speedup taken over the systems that do not
    speculate (plain, transformers, …), of the medians and (`speedup_paired`, given `runs`) the
    median over repeats of each repeat's own ratio."""
    speculating = [name for name in summary if name == "polylane" or name in VARIANTS]
    key = "stream_decode_tokens_per_s"

    def speedups(name: str, phase: str, over: Sequence[str]) -> dict[str, float | None]:
        ours = summary[name][phase].get(key)
        return {other: metrics.ratio(ours, summary[other][phase].get(key), "higher") for other in over}

    def paired(name: str, phase: str, over: Sequence[str]) -> dict[str, float | None]:
        if runs is None:
            return {}
        ours = [r["phases"][phase] for r in runs[name]]
        return {
            other: metrics.paired_ratios(ours, [r["phases"][phase] for r in runs[other]])[key]
            for other in over
        }

    out = {}
    for phase in phases:
        per_system = {}
        for name in speculating:
            spec = (summary[name][phase].get("engine") or {}).get("speculation") or {}
            per_system[name] = {
                "decode_tokens_per_s": summary[name][phase].get(key),
                **{field: spec.get(field) for field in SPEC_KEYS},
                "speedup": speedups(name, phase, [o for o in summary if o not in speculating]),
                "speedup_paired": paired(name, phase, [o for o in summary if o not in speculating]),
            }
        out[phase] = {
            "acceptance_rate": per_system["polylane"]["acceptance_rate"],
            "tokens_per_verify": per_system["polylane"]["tokens_per_verify"],
            "speedup": speedups("polylane", phase, [o for o in summary if o != "polylane"]),
            "systems": per_system,
        }
    return out


def cpu_hog(summary: dict[str, Any], phases: Sequence[str], workload: str) -> dict[str, Any]:
    """Per phase run under busy-loop processes (`+hog`) and per system: the phase's primary
    metric idle and under load, and `kept` = loaded ÷ idle (higher-is-better metrics; for a
    lower-is-better one, idle ÷ loaded), so 1.0 means the neighbour cost nothing."""
    out: dict[str, Any] = {}
    for phase in phases:
        idle = workloads.idle_phase_name(phase)
        if idle == phase or idle not in phases:
            continue
        key = primary_metric(phase, workload)
        better = dict(metrics.RATIO_METRICS).get(key, "higher")
        out[phase] = {
            name: {
                "metric": key,
                "idle": system[idle].get(key),
                "loaded": system[phase].get(key),
                "kept": metrics.ratio(system[phase].get(key), system[idle].get(key), better),
            }
            for name, system in summary.items()
        }
    return out


def cross_model(summary: dict[str, Any], phases: Sequence[str]) -> dict[str, Any]:
    """Per consumer phase of the cross-model shared-prefix workload and per system: the consumer's
    TTFT p50 on prompts the provider prefilled (`shared`) and on unseen ones (`cold`), the
    provider's own (its cold prefill), speedup = cold ÷ shared, `vs_plain` = plain's TTFT on the
    shared prompts (cold for it: no prefix cache) ÷ this system's, and the engine's cross-model
    counters for the consumer (hits, imported tokens, layers skipped per imported token)."""
    out: dict[str, Any] = {}
    for phase in phases:
        per_system = {}
        for name, system in summary.items():
            categories = system[phase].get("per_category") or {}

            def ttft(category: str, categories: dict[str, Any] = categories) -> float | None:
                return (categories.get(category) or {}).get("ttft_p50_s")

            plain = (summary.get("plain", {}).get(phase, {}).get("per_category") or {}).get("shared") or {}
            engine = (system[phase].get("engine") or {}).get("cross_model") or {}
            per_system[name] = {
                "shared_ttft_p50_s": ttft("shared"),
                "cold_ttft_p50_s": ttft("cold"),
                "provider_ttft_p50_s": ttft("provider"),
                "speedup": metrics.ratio(ttft("shared"), ttft("cold"), "lower"),
                "vs_plain": metrics.ratio(ttft("shared"), plain.get("ttft_p50_s"), "lower")
                if name != "plain"
                else None,
                "cached_tokens": (categories.get("shared") or {}).get("cached_tokens"),
                "cross_model": engine.get(phase),
            }
        out[phase] = per_system
    return out


def _load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def environment(load_average: tuple[list[float], list[float]]) -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for package in ("polylane", "torch", "transformers", "openai"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:
            versions[package] = None
    return {
        "git": _git(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "versions": versions,
        "load_average_before": load_average[0],
        "load_average_after": load_average[1],
    }


def _git() -> dict[str, Any] | None:
    """The commit polylane runs from and how many files differ from it (None outside a checkout)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "modified_files": len(changed)}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
