"""What `polylane serve` serves and under which limits: command line and TOML config.

A config file declares models and limits:

    budget = "6GiB"          # bytes, a size with a unit, or "auto"
    api_key = "secret"       # optional; the POLYLANE_API_KEY environment variable also sets it

    [[models]]
    name = "smollm2"                   # the name clients send as `model`
    source = "smollm2-135m-instruct"   # catalogue name, .gguf file or Hugging Face folder
    dtype = "fp32"                     # fp32 | bf16
    pinned = true
    aliases = ["default"]
    kv_tokens = 4096

Model names (and aliases) are looked up in this registry; a name a client sends is never used as
a path. "auto" budgets half of the memory available at start.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from polylane import catalog
from polylane.runtime.residency import DEFAULT_KV_TOKENS

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class ConfigError(ValueError):
    """The command line or the config file is wrong; the message names the setting."""


@dataclass(frozen=True)
class ModelDecl:
    name: str
    source: str
    dtype: str = "fp32"
    pinned: bool = False
    aliases: tuple[str, ...] = ()
    kv_tokens: int = DEFAULT_KV_TOKENS


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20  # request bodies above this are refused (413)
    max_n: int = 4  # choices per request
    max_tokens_default: int = 256  # when a request does not say
    max_waiting_requests: int = 256  # unfinished requests before 429
    max_waiting_tokens: int = 1 << 20  # prompt + max_tokens of unfinished requests before 429
    request_timeout_s: float = 600.0  # a request still running after this ends with "deadline"


@dataclass(frozen=True)
class ServerConfig:
    models: tuple[ModelDecl, ...]
    budget_bytes: int
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    lane_policy: str = "throughput"
    limits: Limits = field(default_factory=Limits)


def parse_size(value: str | int) -> int:
    """Bytes from an int or a string like "6GiB", "512MB", "auto"."""
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"budget must be >= 0, got {value}")
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return psutil.virtual_memory().available // 2
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
    if not match or match[2] not in _UNITS:
        raise ConfigError(f"cannot read size {value!r} (examples: 4000000000, 6GiB, 512MB, auto)")
    return int(float(match[1]) * _UNITS[match[2]])


def model_decl(spec: str, pinned: set[str]) -> ModelDecl:
    """A model named on the command line: catalogue name or path (its name: the catalogue name or
    the file's stem)."""
    name = spec if spec in catalog.CATALOG else Path(spec).stem or spec
    return ModelDecl(name=name, source=spec, pinned=spec in pinned or name in pinned)


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
        unknown = set(entry) - {"name", "source", "dtype", "pinned", "aliases", "kv_tokens"}
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
        aliases = entry.get("aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise ConfigError(f"{where}: aliases must be a list of strings")
        if entry.get("dtype", "fp32") not in ("fp32", "bf16"):
            raise ConfigError(f"{where}: dtype must be fp32 or bf16")
        models.append(
            ModelDecl(
                name=entry["name"],
                source=str(entry.get("source", entry["name"])),
                dtype=entry.get("dtype", "fp32"),
                pinned=bool(entry.get("pinned", False)),
                aliases=tuple(aliases),
                kv_tokens=int(entry.get("kv_tokens", DEFAULT_KV_TOKENS)),
            )
        )
    return models


def check_names(models: list[ModelDecl]) -> None:
    seen: set[str] = set()
    for model in models:
        for name in (model.name, *model.aliases):
            if name in seen:
                raise ConfigError(f"model name {name!r} is declared twice")
            seen.add(name)
