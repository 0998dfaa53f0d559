"""Model management verbs of the `polylane` command, after Ollama's: pull, list, ps, rm.

polylane pull MODEL ...      fetch catalogue models now (progress bars), not on first use
polylane list                the catalogue: cached or not, bytes on disk (file and converted copies)
polylane ps [--url URL]      a running server's models: state, bytes, pins, requests, idle time
polylane rm MODEL ...        remove a fetched model and the weights converted from it
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from polylane import catalog


def add_parsers(commands: argparse._SubParsersAction) -> None:
    pull = commands.add_parser(
        "pull", help="fetch catalogue models now (they are fetched on first use otherwise)"
    )
    pull.add_argument("models", nargs="+", help="catalogue names (see `polylane list`)")
    pull.set_defaults(run=_cmd_pull)

    listing = commands.add_parser("list", help="the catalogue, what is cached and the disk it uses")
    listing.set_defaults(run=_cmd_list)

    ps = commands.add_parser("ps", help="a running server's models: state, bytes, pins, requests, idle time")
    ps.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)"
    )
    ps.add_argument("--api-key", help="its API key, if it has one ($POLYLANE_API_KEY)")
    ps.set_defaults(run=_cmd_ps)

    rm = commands.add_parser(
        "rm", help="remove a fetched model and its converted weights (a .gguf path: only its conversions)"
    )
    rm.add_argument("models", nargs="+", help="catalogue name or .gguf file")
    rm.add_argument(
        "--converted-only", action="store_true", help="keep the fetched file, remove its conversions"
    )
    rm.set_defaults(run=_cmd_rm)


def _entry(name: str) -> catalog.CatalogEntry:
    entry = catalog.CATALOG.get(name)
    if entry is None:
        raise catalog.ModelNotFoundError(f"{name!r} is not in the catalogue ({', '.join(catalog.CATALOG)})")
    return entry


def _cmd_pull(args: argparse.Namespace) -> int:
    entries = [_entry(name) for name in args.models]  # every name checked before any download
    for entry in entries:
        if catalog.is_cached(entry):
            print(f"{entry.name}: already cached ({catalog.cached_path(entry)})")
            continue
        path = catalog.fetch(entry)
        print(f"{entry.name}: fetched {entry.size_bytes / 1e6:,.0f} MB, sha256 checked → {path}")
    return 0


def _megabytes(size: int) -> str:
    return f"{size / 1e6:,.0f} MB"


def _cmd_list(args: argparse.Namespace) -> int:
    from polylane.runtime.loading.converted import conversions_of, converted_dir

    print(
        f"{'name':30} {'arch':7} {'params':>6} {'quant':7} {'file':>9}  {'cached':6} {'converted':>9}  chat"
    )
    fetched = converted_here = 0
    for entry in catalog.CATALOG.values():
        cached = catalog.is_cached(entry)
        converted = sum(p.stat().st_size for p in conversions_of(entry.sha256))
        fetched += catalog.cached_path(entry).stat().st_size if cached else 0
        converted_here += converted
        default = "  (default)" if entry.name == catalog.DEFAULT_MODEL else ""
        print(
            f"{entry.name:30} {entry.architecture:7} {entry.params:>6} {entry.quantization:7} "
            f"{_megabytes(entry.size_bytes):>9}  {'yes' if cached else 'no':6} {_megabytes(converted):>9}  "
            f"{'yes' if entry.has_chat_template else 'no'}{default}"
        )
    root, store = catalog.cache_dir(), converted_dir()
    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.is_dir() else 0
    converted_all = sum(p.stat().st_size for p in store.glob("*.safetensors")) if store.is_dir() else 0
    print(f"\ncache: {root}, {_megabytes(total)} on disk (set ${catalog.CACHE_ENV} to move it):")
    print(
        f"  fetched files {_megabytes(fetched)}, their converted copies {_megabytes(converted_here)}, "
        f"converted copies of other files {_megabytes(converted_all - converted_here)}, "
        f"the rest (tokenizers, digests, siblings) {_megabytes(total - fetched - converted_all)}"
    )
    return 0


def _cmd_ps(args: argparse.Namespace) -> int:
    import httpx

    key = args.api_key or os.environ.get("POLYLANE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = args.url.rstrip("/")
    try:
        response = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
    except httpx.TransportError as error:
        print(
            f"error: no server answers at {url} ({error}); start one with `polylane serve`", file=sys.stderr
        )
        return 1
    if response.status_code != 200:
        message = response.json().get("error", {}).get("message", response.text[:200])
        print(f"error: {url}/v1/models answered {response.status_code}: {message}", file=sys.stderr)
        return 1
    print(f"{'name':30} {'state':9} {'bytes':>10} {'dtype':9} {'pinned':6} {'requests':>8} {'idle':>8}")
    for model in response.json()["data"]:
        idle = model.get("idle_seconds")
        print(
            f"{model['id']:30} {model['state']:9} {_megabytes(model['bytes']):>10} {model['dtype']:9} "
            f"{'yes' if model['pinned'] else 'no':6} {model['in_flight']:>8} "
            f"{'never' if idle is None else _duration(idle):>8}"
        )
    return 0


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _cmd_rm(args: argparse.Namespace) -> int:
    """Remove a catalogue model's fetched file and the weights converted from it; for a local file,
    only its conversions (the file itself is the user's)."""
    from polylane.runtime.loading.converted import remove_conversions

    for name in args.models:
        entry = catalog.CATALOG.get(name)
        path = catalog.cached_path(entry) if entry is not None else Path(name).expanduser()
        if entry is None and not path.is_file():
            raise catalog.ModelNotFoundError(f"{name!r}: not a catalogue name nor a .gguf file")
        conversions = remove_conversions(path) if path.is_file() else []
        converted = sum(size for _, size in conversions)
        fetched = catalog.remove_cached(entry) if entry is not None and not args.converted_only else 0
        parts = [f"{len(conversions)} converted entries ({converted / 1e6:,.0f} MB)"]
        if entry is not None and not args.converted_only:
            parts.insert(0, f"the fetched file ({fetched / 1e6:,.0f} MB)" if fetched else "no fetched file")
        print(f"{name}: removed {' and '.join(parts)}")
    return 0
