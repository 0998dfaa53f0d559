"""Writing a bench's results: results.json, a Markdown table (results.md), PNG plots, and the
one-line JSON summary that ends stdout. No torch.

What this module owns: presentation only. Every number comes from the results document
(`harness.assemble`); nothing is computed here but formatting. Plots use matplotlib's Agg
backend (no display needed):
- `primary.png`: per phase, each system's primary metric (prefill, decode or batch tokens/s in
  `single`, decode tokens/s in `spec`, throughput elsewhere): the median as a bar, the repeats'
  min–max as a whisker, polylane's ratio over each baseline above its bar. In the cross-model
  shared-prefix workload: per consumer, each system's TTFT p50 on shared and on cold prompts side
  by side, cold ÷ shared above them.
- `latency.png`: per phase, TTFT and TPOT p50 (bar) and p99 (whisker top) per system.
- `timeline.png`: the last repeat's requests of each system and phase over time: a thin line from
  send to first token (queueing and prefill), a thick one from first to last token (decoding),
  coloured by model.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

PLOTS = ("primary.png", "latency.png", "timeline.png")

LABELS = {
    "throughput_tokens_per_s": "tokens/s",
    "requests_per_s": "requests/s",
    "prefill_tokens_per_s": "prefill tokens/s",
    "stream_decode_tokens_per_s": "decode tokens/s (per stream)",
    "aggregate_decode_tokens_per_s": "decode tokens/s (all streams)",
    "ttft_p50_s": "TTFT p50",
    "ttft_p99_s": "TTFT p99",
    "tpot_p50_s": "TPOT p50",
    "tpot_p99_s": "TPOT p99",
}


def schema() -> dict[str, Any]:
    """The JSON schema of results.json."""
    return json.loads(resources.files("polylane.bench").joinpath("schema.json").read_text())


def write(results: dict[str, Any], out: Path) -> dict[str, Path]:
    """results.json, results.md and the plots under `out`; their paths by name."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    paths["json"].write_text(json.dumps(results, indent=1) + "\n")
    paths["markdown"].write_text(markdown(results))
    if importlib.util.find_spec("matplotlib") is None:
        print("bench: no plots (pip install 'polylane[bench]' for matplotlib)", file=sys.stderr)
        return paths
    for name in PLOTS:
        paths[name] = out / name
    plot_primary(results, paths["primary.png"])
    plot_latency(results, paths["latency.png"])
    plot_timeline(results, paths["timeline.png"])
    return paths


# ---------------------------------------------------------------------------------- Markdown


def _number(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _ms(value: float | None) -> str:
    if value is None:
        return "—"
    ms = value * 1000
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:,.1f}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _share(values: dict[str, float] | None) -> str:
    if not values:
        return "—"
    return ", ".join(f"{name} {share:.2f}" for name, share in values.items())


def markdown(results: dict[str, Any]) -> str:
    settings, env = results["settings"], results["environment"]
    systems = results["systems"]
    models = ", ".join(
        m["name"] if m["name"] == m["source"] else f"{m['name']}={m['source']}" for m in settings["models"]
    )
    versions = env["versions"]
    lines = [
        f"# polylane bench `{results['workload']}`",
        "",
        f"`{results['command']}`" if results["command"] else "",
        "",
        f"Models {models}; {settings['dtype']}; seed {settings['seed']}; {settings['repeats']} repeat(s), "
        "the median shown, systems alternating their order every repeat. "
        f"{env['cpu_count']} cores ({env.get('processor') or env['machine']}), "
        f"polylane on {settings.get('device', 'cpu')}, "
        f"torch {versions.get('torch')}, transformers {versions.get('transformers')}; "
        f"load average {_loads(env)}{_commit(env)}. "
        "Ratios: how many times better polylane is (> 1: polylane better; rates ours ÷ theirs, latencies "
        "theirs ÷ ours), of the medians; paired: the median over repeats of each repeat's ratio.",
    ]
    for phase in results["phases"]:
        name, primary = phase["name"], phase["primary_metric"]
        lines += ["", f"## `{name}`: {phase['description']}", ""]
        header = ["system", "tokens/s"]
        if primary not in ("throughput_tokens_per_s", "ttft_p50_s"):
            header.append(LABELS[primary])
        header += [
            "TTFT p50 ms",
            "TTFT p99 ms",
            "TPOT p50 ms",
            "TPOT p99 ms",
            "prefix hit",
            "errors",
            "ratio",
        ]
        lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
        for system_name, system in systems.items():
            row = system["summary"][name]
            cells = [system_name, _number(row["throughput_tokens_per_s"])]
            if primary not in ("throughput_tokens_per_s", "ttft_p50_s"):
                cells.append(_number(row[primary]))
            ratio = (system["ratio"] or {}).get(name, {}).get(primary)
            cells += [
                _ms(row["ttft_p50_s"]),
                _ms(row["ttft_p99_s"]),
                _ms(row["tpot_p50_s"]),
                _ms(row["tpot_p99_s"]),
                _number(row["prefix_hit_rate"], 2),
                str(int(row["errors"])),
                "—" if system["ratio"] is None else _ratio(ratio),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        engines = [
            (n, s["summary"][name]["engine"]) for n, s in systems.items() if s["summary"][name]["engine"]
        ]
        if engines:
            lines += [
                "",
                "| system (engine) | decode steps | switches | max concurrent decode | decode batch mean | "
                "lane share | residency hits / misses / evictions | page-in s | preemptions |",
                "|---|---:|---:|---:|---:|---|---:|---:|---:|",
            ]
            for system_name, engine in engines:
                concurrent = engine["max_concurrent_decode"]
                lines.append(
                    f"| {system_name} | {engine['decode_steps']:.0f} | {engine['switches']:.0f} | "
                    f"{'—' if concurrent is None else f'{concurrent:.0f}'} | "
                    f"{_number(engine['decode_batch_mean'], 2)} | {_share(engine['lane_share'])} | "
                    f"{engine['residency_hits']:.0f} / {engine['residency_misses']:.0f} / "
                    f"{engine['residency_evictions']:.0f} | {engine['page_in_seconds']:.2f} | "
                    f"{engine['preemptions']:.0f} |"
                )
        per_model = systems["polylane"]["summary"][name]["per_model"]
        if len(per_model) > 1:
            lane = (systems["polylane"]["summary"][name]["engine"] or {}).get("lane_share") or {}
            lines += [
                "",
                "| polylane, per model | requests | token share | lane share | TTFT p50 ms | TPOT p50 ms |",
                "|---|---:|---:|---:|---:|---:|",
            ]
            for model, row in per_model.items():
                lines.append(
                    f"| {model} | {row['requests']:.0f} | {_number(row['token_share'], 2)} | "
                    f"{_number(lane.get(model), 2)} | {_ms(row['ttft_p50_s'])} | {_ms(row['tpot_p50_s'])} |"
                )
        baselines = [(n, s["ratio"][name]) for n, s in systems.items() if s["ratio"]]
        if baselines:
            keys = ["throughput_tokens_per_s", "ttft_p50_s", "tpot_p50_s"]
            if primary not in keys:
                keys.insert(0, primary)
            lines += [
                "",
                "| polylane ÷ baseline | " + " | ".join(LABELS[k] for k in keys) + " |",
                "|---|" + "---:|" * len(keys),
            ]
            for baseline, ratio in baselines:
                paired = systems[baseline]["paired_ratio"][name]
                lines.append(f"| {baseline} | " + " | ".join(_ratio(ratio.get(k)) for k in keys) + " |")
                lines.append(
                    f"| {baseline}, paired | " + " | ".join(_ratio(paired.get(k)) for k in keys) + " |"
                )
    if results["workload"] == "spec":
        lines += speculation_markdown(results)
    if results.get("cross_model"):
        lines += cross_model_markdown(results)
    if results.get("cpu_hog"):
        lines += cpu_hog_markdown(results)
    lines += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in PLOTS), ""]
    return "\n".join(lines)


def speculation_markdown(results: dict[str, Any]) -> list[str]:
    """The spec workload's summary: decode tokens/s of every system per phase, the speculating
    systems' speedups over the others, and their acceptance, tokens per verify and shapes."""
    phases = [p["name"] for p in results["phases"]]
    systems = results["systems"]
    spec = results["speculation"]
    settings = results["settings"]
    lines = [
        "",
        "## Speculation",
        "",
        f"polylane's speculation: `{json.dumps(settings.get('speculation'))}`"
        + (
            f"; transformers-assisted's assistant: {settings.get('drafter') or 'prompt lookup'}."
            if "transformers-assisted" in systems
            else "."
        ),
        "",
        "| decode tokens/s per stream | " + " | ".join(phases) + " |",
        "|---|" + "---:|" * len(phases),
    ]
    for name, system in systems.items():
        cells = [_number(system["summary"][phase]["stream_decode_tokens_per_s"], 2) for phase in phases]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    speculating = list(spec[phases[0]]["systems"]) if phases else []
    lines += [
        "",
        "| speedup (decode tokens/s ÷), of the medians (paired) | " + " | ".join(phases) + " |",
        "|---|" + "---:|" * len(phases),
    ]
    for name in speculating:
        for other in spec[phases[0]]["systems"][name]["speedup"]:
            cells = []
            for phase in phases:
                row = spec[phase]["systems"][name]
                paired = (row.get("speedup_paired") or {}).get(other)
                cells.append(
                    _ratio(row["speedup"].get(other)) + ("" if paired is None else f" ({_ratio(paired)})")
                )
            lines.append(f"| {name} ÷ {other} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| system | phase | acceptance rate | tokens per verify | drafted | verify passes | chain / tree "
        "rounds | decisions on / off |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in speculating:
        for phase in phases:
            row = spec[phase]["systems"][name]

            def count(key: str, row: dict[str, Any] = row) -> str:
                return "—" if row.get(key) is None else f"{row[key]:.0f}"

            lines.append(
                f"| {name} | {phase} | {_number(row['acceptance_rate'], 2)} | "
                f"{_number(row['tokens_per_verify'], 2)} | {count('drafted_tokens')} | "
                f"{count('verify_steps')} | "
                f"{count('chain_rounds')} / {count('tree_rounds')} | "
                f"{count('decisions_on')} / {count('decisions_off')} |"
            )
    lines += [
        "",
        "Acceptance = accepted ÷ drafted tokens; tokens per verify = tokens a verify pass yields (the "
        "bonus or recovered token included); — where the engine reported no speculation (none "
        "configured, or no drafter for the target).",
    ]
    return lines


def cpu_hog_markdown(results: dict[str, Any]) -> list[str]:
    """`--cpu-hog N`: per phase and system, the primary metric idle and with N busy-loop processes."""
    hogs = results["settings"]["cpu_hog"]
    cpus = results["environment"].get("cpu_count")
    lines = [
        "",
        f"## With {hogs} busy-loop process(es) running" + (f" ({cpus} CPUs)" if cpus else ""),
        "",
        "| phase | system | metric | idle | loaded | kept |",
        "|---|---|---|---:|---:|---:|",
    ]
    for phase, per_system in results["cpu_hog"].items():
        for name, row in per_system.items():
            metric = row["metric"]
            lines.append(
                f"| {phase} | {name} | {LABELS.get(metric, metric)} | {_number(row['idle'], 1)} | "
                f"{_number(row['loaded'], 1)} | {_ratio(row['kept'])} |"
            )
    lines += [
        "",
        "Each phase ran twice in every repeat: idle, and after every idle phase (other prompts, same "
        "shape) while the bench kept busy-loop processes spinning; kept = loaded ÷ idle (1.00×: the "
        "neighbour cost nothing).",
    ]
    return lines


def cross_model_markdown(results: dict[str, Any]) -> list[str]:
    """The cross-model shared-prefix summary: per consumer and system, TTFT shared vs cold."""
    providers = [m["name"] for m in results["settings"]["models"]][:1]
    lines = [
        "",
        f"## Prefill shared across models (provider: {providers[0] if providers else '?'})",
        "",
        "| consumer | system | TTFT shared ms | TTFT cold ms | cold ÷ shared | plain ÷ shared | "
        "provider TTFT ms | cross-model hits | imported tokens | layers skipped per token |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for phase, per_system in results["cross_model"].items():
        for name, row in per_system.items():
            engine = row.get("cross_model") or {}
            hits = "—" if engine.get("hits") is None else f"{engine['hits']:.0f}"
            imported = "—" if engine.get("imported_tokens") is None else f"{engine['imported_tokens']:.0f}"
            lines.append(
                f"| {phase} | {name} | {_ms(row['shared_ttft_p50_s'])} | {_ms(row['cold_ttft_p50_s'])} | "
                f"{_ratio(row['speedup'])} | {_ratio(row['vs_plain'])} | {_ms(row['provider_ttft_p50_s'])} | "
                f"{hits} | {imported} | "
                f"{_number(engine.get('layers_per_token'), 1)} |"
            )
    lines += [
        "",
        "TTFT p50 of the consumer on prompts the provider prefilled just before (shared) and on "
        "prompts no model had seen (cold), alternating; plain has no prefix cache, so every prompt is "
        "cold for it. Hits and imported tokens: the consumer's sequences and prompt tokens whose "
        "lower-band KV came from another model; layers skipped per token: the shared band's depth.",
    ]
    return lines


def _commit(env: dict[str, Any]) -> str:
    git = env.get("git")
    if not git:
        return ""
    dirty = f", {git['modified_files']} files modified" if git["modified_files"] else ""
    return f"; polylane at {git['commit'][:10]}{dirty}"


def _loads(env: dict[str, Any]) -> str:
    before, after = env.get("load_average_before") or [], env.get("load_average_after") or []
    if not before or not after:
        return "unknown"
    return f"{before[0]:.1f} before, {after[0]:.1f} after (1 min)"


# ---------------------------------------------------------------------------------- final line


def final_line(results: dict[str, Any], out: Path) -> str:
    """The one-line JSON document that ends stdout: headline numbers, ratios, where the rest is."""
    keys = ("throughput_tokens_per_s", "ttft_p50_s", "tpot_p50_s", "prefix_hit_rate")
    systems: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    for name, system in results["systems"].items():
        systems[name] = {}
        for phase in results["phases"]:
            row = system["summary"][phase["name"]]
            picked = {k: row[k] for k in (phase["primary_metric"], *keys)}
            engine = row["engine"] or {}
            picked.update({k: engine.get(k) for k in ("switches", "max_concurrent_decode", "lane_share")})
            systems[name][phase["name"]] = picked
        if system["ratio"]:
            ratios[name] = {
                phase["name"]: {
                    k: system["ratio"][phase["name"]].get(k) for k in (phase["primary_metric"], *keys[:3])
                }
                for phase in results["phases"]
            }
    document = {
        "workload": results["workload"],
        "results": str(out / "results.json"),
        "repeats": results["settings"]["repeats"],
        "systems": systems,
        "ratios": ratios,
        "speculation": results["speculation"],
        **({"cross_model": results["cross_model"]} if results.get("cross_model") else {}),
        **({"cpu_hog": results["cpu_hog"]} if results.get("cpu_hog") else {}),
        "load_average": [
            (results["environment"]["load_average_before"] or [None])[0],
            (results["environment"]["load_average_after"] or [None])[0],
        ],
    }
    return json.dumps(document)


# ---------------------------------------------------------------------------------- plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colours(names: Sequence[str]) -> dict[str, Any]:
    plt = _pyplot()
    cycle = plt.get_cmap("tab10")
    return {name: cycle(i % 10) for i, name in enumerate(names)}


def plot_primary(results: dict[str, Any], path: Path) -> None:
    if results.get("cross_model"):
        plot_cross_model(results, path)
        return
    plt = _pyplot()
    phases, systems = results["phases"], results["systems"]
    colours = _colours(list(systems))
    figure, axes = plt.subplots(1, len(phases), figsize=(4.2 * len(phases), 3.6), squeeze=False)
    for axis, phase in zip(axes[0], phases, strict=True):
        key = phase["primary_metric"]
        names = list(systems)
        medians = [systems[n]["summary"][phase["name"]][key] or 0.0 for n in names]
        spread = [[r["phases"][phase["name"]][key] or 0.0 for r in systems[n]["runs"]] for n in names]
        low = [m - min(s) for m, s in zip(medians, spread, strict=True)]
        high = [max(s) - m for m, s in zip(medians, spread, strict=True)]
        bars = axis.bar(names, medians, color=[colours[n] for n in names], yerr=[low, high], capsize=3)
        for bar, name, top in zip(bars, names, spread, strict=True):
            ratio = (systems[name]["ratio"] or {}).get(phase["name"], {}).get(key)
            if ratio is not None:
                axis.annotate(
                    f"polylane {ratio:.2f}×",
                    (bar.get_x() + bar.get_width() / 2, max(bar.get_height(), *top)),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    xytext=(0, 4),
                    textcoords="offset points",
                )
        axis.set_title(phase["name"], fontsize=10)
        axis.set_ylabel(LABELS[key], fontsize=8)
        axis.tick_params(axis="x", labelsize=8, rotation=20)
        axis.tick_params(axis="y", labelsize=8)
        axis.margins(y=0.15)
    _finish(figure, path, f"polylane bench {results['workload']}: median of {results['settings']['repeats']}")


def _finish(figure: Any, path: Path, title: str) -> None:
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    _pyplot().close(figure)


def plot_cross_model(results: dict[str, Any], path: Path) -> None:
    """Per consumer: each system's TTFT p50 on shared prompts and on cold ones, cold ÷ shared above."""
    plt = _pyplot()
    cross = results["cross_model"]
    figure, axes = plt.subplots(1, len(cross), figsize=(4.6 * len(cross), 3.6), squeeze=False)
    colours = _colours(["shared", "cold"])
    for axis, (phase, per_system) in zip(axes[0], cross.items(), strict=True):
        names = list(per_system)
        width = 0.38
        for offset, kind in ((-width / 2, "shared"), (width / 2, "cold")):
            values = [1000 * (per_system[n][f"{kind}_ttft_p50_s"] or 0.0) for n in names]
            axis.bar([i + offset for i in range(len(names))], values, width, label=kind, color=colours[kind])
        for i, name in enumerate(names):
            row = per_system[name]
            top = 1000 * max(row["shared_ttft_p50_s"] or 0.0, row["cold_ttft_p50_s"] or 0.0)
            if row["speedup"] is not None:
                axis.annotate(
                    f"{row['speedup']:.2f}×", (i, top), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 4), textcoords="offset points",
                )  # fmt: skip
        axis.set_xticks(range(len(names)), names, fontsize=8)
        axis.set_title(f"consumer {phase}: TTFT p50", fontsize=10)
        axis.set_ylabel("ms", fontsize=8)
        axis.tick_params(axis="y", labelsize=8)
        axis.legend(fontsize=8, frameon=False)
        axis.margins(y=0.15)
    _finish(
        figure,
        path,
        f"polylane bench shared-prefix across models: median of {results['settings']['repeats']}",
    )


def plot_latency(results: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    phases, systems = results["phases"], results["systems"]
    colours = _colours(list(systems))
    figure, axes = plt.subplots(len(phases), 2, figsize=(9, 2.8 * len(phases)), squeeze=False)
    for row, phase in enumerate(phases):
        for column, (p50, p99, title) in enumerate(
            (
                ("ttft_p50_s", "ttft_p99_s", "time to first token"),
                ("tpot_p50_s", "tpot_p99_s", "time per output token"),
            )
        ):
            axis = axes[row][column]
            names = list(systems)
            if all(systems[n]["summary"][phase["name"]][p50] is None for n in names):
                axis.text(0.5, 0.5, "not measured", ha="center", va="center", transform=axis.transAxes)
                axis.set_title(f"{phase['name']}: {title}", fontsize=9)
                axis.set_axis_off()
                continue
            medians = [1000 * (systems[n]["summary"][phase["name"]][p50] or 0.0) for n in names]
            tails = [1000 * (systems[n]["summary"][phase["name"]][p99] or 0.0) for n in names]
            axis.bar(
                names,
                medians,
                color=[colours[n] for n in names],
                yerr=[[0.0] * len(names), [max(0.0, t - m) for t, m in zip(tails, medians, strict=True)]],
                capsize=3,
            )
            axis.set_title(f"{phase['name']}: {title} (p50, whisker p99)", fontsize=9)
            axis.set_ylabel("ms", fontsize=8)
            axis.tick_params(axis="x", labelsize=8, rotation=20)
            axis.tick_params(axis="y", labelsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_timeline(results: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    phases, timelines = results["phases"], results["timelines"]
    names = list(timelines)
    models = sorted({m["name"] for m in results["settings"]["models"]})
    colours = _colours(models)
    figure, axes = plt.subplots(
        len(phases), len(names), figsize=(4.5 * len(names), 2.6 * len(phases)), squeeze=False, sharey="row"
    )
    for row, phase in enumerate(phases):
        for column, name in enumerate(names):
            axis = axes[row][column]
            for index, t in enumerate(timelines[name].get(phase["name"], [])):
                colour = colours.get(t["model"], "grey")
                if t["first_token"] is None:
                    axis.plot([t["sent"]], [index], marker="x", color="red", markersize=4)
                    continue
                axis.plot(
                    [t["sent"], t["first_token"]], [index, index], color=colour, linewidth=0.8, alpha=0.5
                )
                end = t["last_token"] if t["last_token"] is not None else t["first_token"]
                axis.plot([t["first_token"], end], [index, index], color=colour, linewidth=2.5)
            axis.yaxis.set_major_locator(MaxNLocator(integer=True))
            axis.set_title(f"{name}: {phase['name']}", fontsize=9)
            axis.set_xlabel("seconds", fontsize=8)
            axis.tick_params(labelsize=7)
            if column == 0:
                axis.set_ylabel("request", fontsize=8)
    handles = [plt.Line2D([0], [0], color=colours[m], linewidth=2.5) for m in models]
    figure.legend(handles, models, loc="lower center", ncol=len(models), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
