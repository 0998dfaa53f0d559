"""What `polylane serve` serves and under which limits: command line and TOML config.

A config file declares models and limits:

    budget = "6GiB"          # bytes, a size with a unit, or "auto"
    device = "auto"          # auto (CUDA when torch sees a GPU, else CPU) | cpu | cuda | cuda:N
    threads = 0              # compute threads: 0 adapts to the machine's load (every core when idle)
    api_key = "secret"       # optional; the POLYLANE_API_KEY environment variable also sets it

    [[models]]
    name = "smollm2"                   # the name clients send as `model`
    source = "smollm2-135m-instruct"   # catalogue name, .gguf file or Hugging Face folder
    dtype = "auto"                     # auto (the file's own) | fp32 | bf16 | int8 | int4
    pinned = true
    aliases = ["default"]
    kv_tokens = 4096
    speculation = { drafters = ["ngram"] }   # optional: speculative decoding (see below)

    [[models]]
    name = "smollm2-top"               # a sibling: smollm2 with its top 15 layers changed,
    sibling_of = "smollm2-135m-instruct"   # written once under the cache (or at `source`)
    top_layers = 15                    # it shares layers [0, 15) with smollm2: a prompt one of
    seed = 1                           # them prefilled is reused by the other (layer share)
    # finetune = "notes.txt"           # instead of seed: fine-tune the top layers on this text
    # steps = 20                       # fine-tune steps (learning_rate = 1e-4, scale = 0.05)

`speculation` (per model) turns speculative decoding on for its requests: true (defaults: every
resident same-tokenizer smaller model and n-gram lookup), a list of drafters ("ngram", "twin" or
"twin:int8" for the model's quantised twin, or a served model's name), or a table with any of
`SpeculationConfig`'s fields (drafters, mode = "auto" | "chain" | "tree", shape = "chain:4" |
"topk:3,2,1" | "beam:2x4" | "dynamic:6,4,16", max_draft_tokens, max_tree_nodes, adaptive, …).

Model names (and aliases) are looked up in this registry; a name a client sends is never used as
a path. "auto" budgets half of the memory available at start: of host RAM on CPU, of the GPU's
free memory on CUDA.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from polylane import catalog
from polylane.policy.residency.eviction import DEFAULT_EVICTION
from polylane.policy.speculation.control import SpeculationConfig
from polylane.runtime.loading.model_record import DEFAULT_KV_TOKENS
from polylane.runtime.residency.siblings import SiblingError, SiblingSpec, ensure_sibling, sibling_path
from polylane.sizes import parse_bytes
from polylane.types import DEFAULT_DTYPE, SAMPLING_FIELDS, WEIGHT_DTYPES, SamplingDefaults


class ConfigError(ValueError):
    """The command line or the config file is wrong; the message names the setting."""


@dataclass(frozen=True)
class ModelDecl:
    name: str
    source: str
    dtype: str = DEFAULT_DTYPE
    pinned: bool = False
    aliases: tuple[str, ...] = ()
    kv_tokens: int = DEFAULT_KV_TOKENS
    speculation: SpeculationConfig | None = None
    sibling_of: str | None = None  # `source` is then a sibling of this model, written if missing
    sibling: SiblingSpec | None = None


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20  # request bodies above this are refused (413)
    max_n: int = 4  # choices per request
    max_tokens_default: int = 256  # when a request does not say
    max_waiting_requests: int = 256  # unfinished requests before 429
    max_waiting_tokens: int = 1 << 20  # prompt + max_tokens of unfinished requests before 429
    request_timeout_s: float = 600.0  # a request still running after this ends with "deadline"
    max_queue_s: float = 120.0  # a request not begun (no prefill) after this gets 503 "queue_timeout"


@dataclass(frozen=True)
class ServerConfig:
    models: tuple[ModelDecl, ...]
    budget_bytes: int
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    lane_policy: str = "throughput"
    eviction: str = DEFAULT_EVICTION  # which idle model leaves first under the budget (policy/residency)
    limits: Limits = field(default_factory=Limits)
    device: str = "auto"
    threads: int = 0  # compute threads (EngineConfig.threads): 0 adapts to the machine's load
    drain_timeout_s: float = 30.0  # after SIGTERM, how long requests in flight may run before they end
    strict: bool = False  # a declared model that cannot be registered stops the start (else others serve)
    # over every model's sampling defaults for the fields a request leaves unset (serve's --temperature,
    # --top-k, --top-p, --min-p; the config file's keys of those names)
    sampling: dict[str, float | int] = field(default_factory=dict)
    metrics_public: bool = False  # /metrics answers without the API key
    allowed_origins: tuple[str, ...] = ()  # CORS origins (serve --allowed-origins; "*" for any)
    log_level: str = "info"  # polylane's and uvicorn's loggers (server.logs)
    log_format: str = "text"  # or "json": one object per line


def sampling_overrides(flags: dict[str, object], file_data: dict[str, object]) -> dict[str, float | int]:
    """serve's sampling defaults from its flags, else the config file; checked as a request's are."""
    chosen = {
        name: flags[name] if flags.get(name) is not None else file_data.get(name) for name in SAMPLING_FIELDS
    }
    chosen = {name: value for name, value in chosen.items() if value is not None}
    for name, value in chosen.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (name == "top_k" and not isinstance(value, int))
        ):
            raise ConfigError(f"{name} must be a number, got {value!r}")
    try:
        SamplingDefaults().override(**chosen)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return chosen


def choice(
    name: str, flag: str | None, file_data: dict[str, Any], allowed: tuple[str, ...], default: str
) -> str:
    """A setting from its flag, else the config file, else `default`; one of `allowed`."""
    value = flag if flag is not None else file_data.get(name, default)
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)


def origins(flags: list[str] | None, configured: object) -> tuple[str, ...]:
    """CORS origins from the flags (repeatable, comma-separated), else the config file's list."""
    if flags:
        return tuple(o.strip() for flag in flags for o in flag.split(",") if o.strip())
    if configured is None:
        return ()
    if not isinstance(configured, list) or not all(isinstance(o, str) and o for o in configured):
        raise ConfigError(f"allowed_origins must be a list of origins, got {configured!r}")
    return tuple(configured)


def parse_threads(value: object) -> int:
    """A thread count from the command line or the config file: an int >= 0 (0: adapt), or "auto"."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return 0
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"threads must be a count >= 0 or auto, got {value!r}")
    try:
        threads = int(value)
    except ValueError:
        raise ConfigError(f"threads must be a count >= 0 or auto, got {value!r}") from None
    if threads < 0:
        raise ConfigError(f"threads must be >= 0 (0 or auto: adapt to the machine's load), got {threads}")
    return threads


def parse_size(value: str | int, free_bytes: Callable[[], int] | None = None) -> int:
    """Bytes from an int or a size (`polylane.sizes`: "6G", "6GiB", "6000MB"), or "auto" (half of
    `free_bytes()`, by default of the host's available RAM)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return (free_bytes() if free_bytes else psutil.virtual_memory().available) // 2
    try:
        return parse_bytes(value)
    except ValueError as error:
        raise ConfigError(f"budget: {error}") from None


def model_decl(spec: str, pinned: set[str], kv_tokens: int | None = None) -> ModelDecl:
    """A model named on the command line: a catalogue name or path (its name: the catalogue name or
    the file's stem), or NAME=SOURCE to serve SOURCE under NAME."""
    name, equals, source = spec.partition("=")
    if not equals or "/" in name or Path(spec).expanduser().exists():
        source = spec
        name = spec if spec in catalog.CATALOG else Path(spec).stem or spec
    elif not name or not source:
        raise ConfigError(f"{spec!r}: write NAME=SOURCE (a catalogue name or a path after '=')")
    pin = source in pinned or name in pinned
    return ModelDecl(name=name, source=source, pinned=pin, kv_tokens=kv_tokens or DEFAULT_KV_TOKENS)


def load_config_file(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as error:
        raise ConfigError(f"{path}: cannot read ({error})") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML ({error})") from None


def models_from_file(data: dict[str, Any], path: str | Path) -> list[ModelDecl]:
    declared = data.get("models", [])
    if not isinstance(declared, list):
        raise ConfigError(f"{path}: models must be an array of tables ([[models]])")
    models = []
    for index, entry in enumerate(declared):
        where = f"{path}: models[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ConfigError(f"{where}: needs a name")
        unknown = set(entry) - {
            "name",
            "source",
            "dtype",
            "pinned",
            "aliases",
            "kv_tokens",
            "speculation",
            *_SIBLING_KEYS,
        }
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
        aliases = entry.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise ConfigError(f"{where}: aliases must be a list of strings")
        if entry.get("dtype", DEFAULT_DTYPE) not in WEIGHT_DTYPES:
            raise ConfigError(f"{where}: dtype must be one of {', '.join(WEIGHT_DTYPES)}")
        sibling_of, sibling = _sibling(entry, where)
        source = entry.get("source", entry["name"])
        if sibling_of is not None and sibling is not None and "source" not in entry:
            try:
                source = sibling_path(sibling_of, sibling)
            except OSError as error:
                raise ConfigError(f"{where}: cannot read the fine-tuning text ({error})") from None
        models.append(
            ModelDecl(
                name=entry["name"],
                source=str(source),
                dtype=entry.get("dtype", DEFAULT_DTYPE),
                pinned=bool(entry.get("pinned", False)),
                aliases=tuple(aliases),
                kv_tokens=int(entry.get("kv_tokens", DEFAULT_KV_TOKENS)),
                speculation=_speculation(entry.get("speculation"), where),
                sibling_of=sibling_of,
                sibling=sibling,
            )
        )
    return models


_SIBLING_KEYS = ("sibling_of", "top_layers", "seed", "scale", "finetune", "steps", "learning_rate")


def _sibling(entry: dict[str, Any], where: str) -> tuple[str | None, SiblingSpec | None]:
    """A sibling declaration (`sibling_of`, `top_layers`, and `seed` or `finetune`), if any."""
    if "sibling_of" not in entry:
        given = sorted(set(entry) & set(_SIBLING_KEYS))
        if given:
            raise ConfigError(f"{where}: {', '.join(given)} only apply with sibling_of")
        return None, None
    if not isinstance(entry["sibling_of"], str) or not isinstance(entry.get("top_layers"), int):
        raise ConfigError(f"{where}: sibling_of needs a model name and top_layers an integer")
    finetune = entry.get("finetune")
    if finetune is not None and "seed" in entry:
        raise ConfigError(f"{where}: give seed (perturbation) or finetune (a text file), not both")
    try:
        spec = SiblingSpec(
            top_layers=entry["top_layers"],
            seed=None if finetune is not None else int(entry.get("seed", 0)),
            scale=float(entry.get("scale", 0.05)),
            finetune_text=None if finetune is None else str(finetune),
            steps=int(entry.get("steps", 20)),
            learning_rate=float(entry.get("learning_rate", 1e-4)),
        )
    except (SiblingError, TypeError, ValueError) as error:
        raise ConfigError(f"{where}: {error}") from None
    return entry["sibling_of"], spec


def ensure_siblings(models: list[ModelDecl], *, quiet: bool = False) -> None:
    """Write every declared sibling that is not on disk yet (once; later starts reuse it)."""
    for model in models:
        if model.sibling_of is not None and model.sibling is not None:
            if not quiet:
                print(f"polylane: preparing sibling {model.name} of {model.sibling_of} …", file=sys.stderr)
            try:
                ensure_sibling(model.sibling_of, model.sibling, model.source, quiet=quiet)
            except (ValueError, OSError, RuntimeError) as error:  # bad spec, unknown source, load error
                raise ConfigError(f"model {model.name!r}: cannot write its sibling: {error}") from None


def _speculation(value: Any, where: str) -> SpeculationConfig | None:
    try:
        return SpeculationConfig.parse(value)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{where}: speculation: {error}") from None


def check_names(models: list[ModelDecl]) -> None:
    seen: set[str] = set()
    for model in models:
        for name in (model.name, *model.aliases):
            if name in seen:
                raise ConfigError(f"model name {name!r} is declared twice")
            seen.add(name)
