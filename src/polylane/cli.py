"""The `polylane` command: serve models, manage them, generate text.

polylane serve [MODEL|NAME=SOURCE ...]  the OpenAI-compatible server (default model when none given)
polylane serve --ray --replicas N       the same routes over N engines under Ray Serve (model affinity)
polylane pull | list | ps | rm          fetch, list, see a server's, remove models (cli_manage.py)
polylane generate [MODEL] PROMPT        stream a completion to the terminal (cli_generate.py)
polylane chat [MODEL]                   talk to a chat model in the terminal (cli_generate.py)
polylane models inspect A B             the layer band two models share (cross-model prefill share)
polylane models sibling SRC OUT         write a sibling of SRC with its top layers changed
polylane bench WORKLOAD                 measure polylane against its baselines (polylane/bench/)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from polylane import catalog
from polylane.cli_generate import DEVICE_HELP
from polylane.policy.residency.eviction import DEFAULT_EVICTION, EVICTION_POLICIES
from polylane.policy.scheduling.lane import LANE_POLICIES
from polylane.server.logs import FORMATS, LEVELS
from polylane.types import SAMPLING_FIELDS, WEIGHT_DTYPES, LoadError


def _cmd_models(args: argparse.Namespace) -> int:
    if args.models_command == "inspect":
        return _cmd_models_inspect(args)
    if args.models_command == "sibling":
        return _cmd_models_sibling(args)
    print(f"{'name':32} {'arch':8} {'params':>7} {'quant':8} {'size':>9}  cached  chat")
    for entry in catalog.CATALOG.values():
        cached = "yes" if catalog.is_cached(entry) else "no"
        chat = "yes" if entry.has_chat_template else "no"
        default = "  (default)" if entry.name == catalog.DEFAULT_MODEL else ""
        print(
            f"{entry.name:32} {entry.architecture:8} {entry.params:>7} {entry.quantization:8} "
            f"{entry.size_bytes / 1e6:7,.0f} MB  {cached:6}  {chat}{default}"
        )
    print(f"\ncache: {catalog.cache_dir()}  (set ${catalog.CACHE_ENV} to move it)")
    return 0


def _cmd_models_inspect(args: argparse.Namespace) -> int:
    from polylane.policy.sharing.layer_share import shared_band
    from polylane.runtime.loading.loaded_model import digest_of

    first, second = (digest_of(name, args.dtype, quiet=False) for name in (args.a, args.b))
    band = shared_band(first, second)
    print(f"A: {args.a} ({args.dtype}): {first.num_layers} layers")
    print(f"B: {args.b} ({args.dtype}): {second.num_layers} layers")
    parts = [
        ("tokenizer", "tokenizer"),
        ("RoPE configuration", "rope"),
        ("KV layout", "kv_layout"),
        ("layer hyper-parameters", "compute"),
        ("embedding", "embedding"),
        ("final norm + head", "head"),
    ]
    for label, field in parts:
        print(f"  {label:24} {'same' if getattr(first, field) == getattr(second, field) else 'differs'}")
    same = [a == b for a, b in zip(first.layers, second.layers, strict=False)]
    differing = [i for i, equal in enumerate(same) if not equal]
    print(f"  {'layers with equal bytes':24} {len(same) - len(differing)} of {len(same)}", end="")
    print(f" (first differing: {differing[0]})" if differing else "")
    deepest = max(first.num_layers, second.num_layers)
    print(
        f"shared band: [0, {band.layers}) — {band.layers} of {deepest} layers "
        f"({band.layers / deepest:.0%}){'; identical models' if band.identical else ''}: {band.reason}"
    )
    return 0


def _cmd_models_sibling(args: argparse.Namespace) -> int:
    from polylane.runtime.residency.siblings import SiblingSpec, write_sibling

    spec = SiblingSpec(
        top_layers=args.top_layers,
        seed=None if args.finetune else args.seed,
        scale=args.scale,
        finetune_text=args.finetune,
        steps=args.steps,
        learning_rate=args.learning_rate,
        sequence_length=args.sequence_length,
    )
    report = write_sibling(args.source, args.out, spec, quiet=False)
    how = f"fine-tuned {spec.steps} steps on {spec.finetune_text}" if spec.finetune_text else "perturbed"
    print(
        f"wrote {report.path}: {args.source} with layers {report.changed_layers[0]}-"
        f"{report.changed_layers[-1]} {how}"
    )
    if report.losses:
        print(f"fine-tune loss: {report.losses[0]:.4f} → {report.losses[-1]:.4f}")
    if report.band is not None:
        print(f"shares layers [0, {report.band.layers}) of {report.num_layers} with {args.source} (checked)")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import os

    from polylane.runtime.model.device import free_memory_bytes, resolve_device
    from polylane.server import config as server_config
    from polylane.server.app import serve

    file_data = server_config.load_config_file(args.config) if args.config else {}
    known = {
        "budget", "api_key", "host", "port", "lane_policy", "eviction", "models", "device", "threads",
        "strict", "drain_timeout", "max_queue_seconds", "log_level", "log_format", "metrics_public",
        "allowed_origins",
        *SAMPLING_FIELDS,
    }  # fmt: skip
    unknown = set(file_data) - known
    if unknown:
        raise server_config.ConfigError(f"{args.config}: unknown settings {sorted(unknown)}")
    device_name = args.device or str(file_data.get("device", "auto"))
    device = resolve_device(device_name)  # a device that is not there fails here, before any load
    pinned = set(args.pin or [])
    if args.kv_tokens is not None and args.kv_tokens < 1:
        raise server_config.ConfigError(f"--kv-tokens must be >= 1, got {args.kv_tokens}")
    models = server_config.models_from_file(file_data, args.config) if args.config else []
    models += [server_config.model_decl(spec, pinned, args.kv_tokens) for spec in args.models]
    if not models:
        models = [server_config.model_decl(catalog.DEFAULT_MODEL, pinned, args.kv_tokens)]
    declared = {m.name for m in models} | {a for m in models for a in m.aliases}
    for name in pinned - declared - {m.source for m in models}:
        raise server_config.ConfigError(f"--pin {name}: not one of the served models")
    if args.dtype:
        models = [dataclasses.replace(m, dtype=args.dtype) for m in models]
    server_config.check_names(models)
    server_config.ensure_siblings(models)
    budget = args.budget or str(file_data.get("budget", "auto"))
    shares = args.replicas if args.ray and budget == "auto" else 1  # under --ray the budget is per replica
    config = server_config.ServerConfig(
        models=tuple(models),
        budget_bytes=server_config.parse_size(budget, lambda: free_memory_bytes(device)) // shares,
        device=device_name,
        host=args.host or str(file_data.get("host", "127.0.0.1")),
        port=args.port or int(file_data.get("port", 8000)),
        api_key=args.api_key or file_data.get("api_key") or os.environ.get("POLYLANE_API_KEY") or None,
        lane_policy=server_config.choice(
            "lane_policy", args.lane_policy, file_data, tuple(LANE_POLICIES), "throughput"
        ),
        eviction=server_config.choice(
            "eviction", args.eviction, file_data, tuple(EVICTION_POLICIES), DEFAULT_EVICTION
        ),
        threads=server_config.parse_threads(args.threads or file_data.get("threads", 0)),
        strict=args.strict or file_data.get("strict") is True,
        sampling=server_config.sampling_overrides(vars(args), file_data),
        metrics_public=args.metrics_public or file_data.get("metrics_public") is True,
        allowed_origins=server_config.origins(args.allowed_origins, file_data.get("allowed_origins")),
        log_level=server_config.choice("log_level", args.log_level, file_data, LEVELS, "info"),
        log_format=server_config.choice("log_format", args.log_format, file_data, FORMATS, "text"),
        drain_timeout_s=_seconds("drain timeout", args.drain_timeout, file_data.get("drain_timeout", 30)),
        limits=server_config.Limits(
            max_queue_s=_seconds(
                "max queue seconds", args.max_queue_seconds, file_data.get("max_queue_seconds", 120)
            )
        ),
    )
    if args.ray:
        try:
            from polylane.server.ray_app import RayOptions, serve_ray
        except ImportError as error:
            raise ValueError(f"--ray needs Ray Serve: pip install 'polylane[ray]' ({error})") from None
        serve_ray(config, RayOptions(replicas=args.replicas))
        return 0
    serve(config)
    return 0


def _seconds(what: str, flag: float | None, configured: object) -> float:
    """A duration in seconds from the flag, else the config file (a number >= 0)."""
    value = flag if flag is not None else configured
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{what} must be a number of seconds >= 0, got {value!r}")
    return float(value)


class _VersionAction(argparse.Action):
    """--version: print `compute_paths.version_text()` and exit (torch is imported only then)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from polylane.runtime.model.compute_paths import version_text

        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polylane", description="Host many models, share the prefill, decode one."
    )
    parser.add_argument(
        "--version",
        action=_VersionAction,
        help="the version, torch build and compute path of each dtype here",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    from polylane.cli_manage import add_parsers as add_manage_parsers

    add_manage_parsers(commands)
    serve = commands.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "models",
        nargs="*",
        help=f"catalogue names or paths, or NAME=SOURCE to serve one under another name "
        f"(default: {catalog.DEFAULT_MODEL})",
    )
    serve.add_argument(
        "--kv-tokens",
        type=int,
        help="KV cache tokens reserved per model named here (default 4096, at most its context)",
    )
    serve.add_argument("--config", help="TOML file declaring models (dtype, pinned, aliases) and limits")
    serve.add_argument(
        "--budget", help="memory budget: bytes, a size like 6GiB, or auto (half of free RAM or GPU memory)"
    )
    serve.add_argument("--device", help=DEVICE_HELP)
    serve.add_argument(
        "--threads",
        help="compute threads: auto (default) uses every core while the machine is idle and one fewer "
        "per core other processes keep busy; N fixes N",
    )
    serve.add_argument("--pin", action="append", help="never evict this model for room (repeatable)")
    serve.add_argument(
        "--drain-timeout",
        type=float,
        help="after SIGTERM, seconds requests in flight may run before they end with an error (default 30)",
    )
    serve.add_argument(
        "--max-queue-seconds",
        type=float,
        help="a request not begun after this many seconds gets 503 with Retry-After (default 120)",
    )
    serve.add_argument(
        "--strict",
        action="store_true",
        help="exit if any declared model cannot be served (default: serve the others, report it)",
    )
    serve.add_argument(
        "--dtype",
        choices=WEIGHT_DTYPES,
        help="weight dtype for every model (default auto: a GGUF file's own quantised blocks, used "
        "in place; fp32/bf16: dequantised; int8/int4: weight-only re-quantised projections)",
    )
    for flag, kind, default in (
        ("--temperature", float, 0.8),
        ("--top-k", int, 40),
        ("--top-p", float, 0.95),
        ("--min-p", float, 0.05),
    ):
        serve.add_argument(
            flag,
            type=kind,
            help=f"for requests that leave it unset, over each model's own setting (else {default})",
        )
    serve.add_argument(
        "--log-level",
        choices=LEVELS,
        help="info (default): loads, evictions, budget and pins, one line per request",
    )
    serve.add_argument("--log-format", choices=FORMATS, help="text (default) or json (one object per line)")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default 8000)")
    serve.add_argument(
        "--api-key", help="require this key on every route but the health probes ($POLYLANE_API_KEY)"
    )
    serve.add_argument(
        "--allowed-origins",
        action="append",
        help="a browser origin that may call the API (CORS), e.g. http://localhost:3000, or * for any; "
        "repeatable or comma-separated (default: none, CORS off)",
    )
    serve.add_argument(
        "--metrics-public", action="store_true", help="/metrics answers without the API key (for a scraper)"
    )
    serve.add_argument("--lane-policy", choices=list(LANE_POLICIES), help="decode lane policy")
    serve.add_argument(
        "--eviction",
        choices=list(EVICTION_POLICIES),
        help="which idle model leaves first when the budget needs room: lru (default), or cost (the least "
        "reload time saved per byte held, GreedyDual-Size-Frequency)",
    )
    serve.add_argument(
        "--ray",
        action="store_true",
        help="serve replicas under Ray Serve, routed by model (pip install polylane[ray])",
    )
    serve.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="with --ray: polylane engines, each with its own --budget (default 2)",
    )
    serve.set_defaults(run=_cmd_serve)

    models = commands.add_parser("models", help="list the model catalogue; inspect or derive models")
    models.set_defaults(run=_cmd_models, models_command=None)
    models_commands = models.add_subparsers(dest="models_command")
    inspect = models_commands.add_parser("inspect", help="the layer band two models share")
    inspect.add_argument("a", help="catalogue name, .gguf file or HF folder")
    inspect.add_argument("b", help="catalogue name, .gguf file or HF folder")
    inspect.add_argument(
        "--dtype", default="fp32", choices=["fp32", "bf16"], help="weight dtype to compare at"
    )
    sibling = models_commands.add_parser(
        "sibling", help="write a HF folder: SOURCE with its top layers changed, lower layers byte-identical"
    )
    sibling.add_argument("source", help="catalogue name, .gguf file or HF folder")
    sibling.add_argument("out", help="the new folder to write (must not exist)")
    sibling.add_argument("--top-layers", type=int, required=True, help="how many top layers change")
    sibling.add_argument("--seed", type=int, default=0, help="seeded perturbation (default, for tests)")
    sibling.add_argument(
        "--scale", type=float, default=0.05, help="perturbation std, relative to each tensor's"
    )
    sibling.add_argument(
        "--finetune", metavar="TEXT_FILE", help="fine-tune the top layers on this text instead"
    )
    sibling.add_argument("--steps", type=int, default=20, help="fine-tune steps")
    sibling.add_argument("--learning-rate", type=float, default=1e-4, help="fine-tune AdamW learning rate")
    sibling.add_argument("--sequence-length", type=int, default=128, help="fine-tune window, in tokens")

    from polylane.cli_generate import add_parsers as add_generate_parsers

    add_generate_parsers(commands)

    from polylane.bench.command import add_parser as add_bench_parser

    add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (catalog.ModelNotFoundError, catalog.FetchError, LoadError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
