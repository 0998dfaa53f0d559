"""Shared fixtures: real models fetched once per machine, loaded once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from polylane import catalog

RUN_SLOW = os.environ.get("POLYLANE_SLOW") == "1"

# The suite converts its real models at fp32 and bf16 (Qwen2.5-Coder-1.5B at fp32 alone is 7.1 GB):
# about 13.5 GB of converted weights, past the converted cache's default 8 GiB cap. Under that cap
# every run evicted and re-dequantised the same models (up to 80 s for the 1.5B, 5-20 s for the
# others), so the suite raises the cap for itself unless $POLYLANE_CONVERTED_CAP says otherwise.
# (Worker processes, bench systems and Ray replicas inherit it.)
SUITE_CONVERTED_CAP = 16 << 30
os.environ.setdefault("POLYLANE_CONVERTED_CAP", str(SUITE_CONVERTED_CAP))


_DESELECTED_SLOW: list[str] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow real-model tests are a tier of their own (POLYLANE_SLOW=1): deselected, not skipped, so
    that a skip always means a missing CPU feature, compiler or GPU; the summary names them."""
    if RUN_SLOW:
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        items[:] = [item for item in items if "slow" not in item.keywords]
        config.hook.pytest_deselected(items=slow)
        _DESELECTED_SLOW.extend(item.nodeid for item in slow)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _DESELECTED_SLOW:
        terminalreporter.write_line(
            f"{len(_DESELECTED_SLOW)} slow real-model tests deselected (run them with POLYLANE_SLOW=1): "
            + ", ".join(_DESELECTED_SLOW)
        )


def fetch_or_skip(name: str) -> catalog.ModelSource:
    """The real model's files, fetched on first use; skip (visibly) only if fetching is impossible."""
    try:
        return catalog.resolve(name, quiet=True)
    except catalog.FetchError as error:
        pytest.skip(f"cannot fetch real model {name}: {error}")


_LOADED: dict[tuple[str, str], object] = {}


@pytest.fixture(scope="session")
def load_real_model() -> Callable[..., object]:
    """load_real_model(name, dtype="fp32") → LoadedModel, shared by every test of the session."""
    from polylane.runtime.loading.loaded_model import load_model

    def load(name: str, dtype: str = "fp32"):
        key = (name, dtype)
        if key not in _LOADED:
            fetch_or_skip(name)
            _LOADED[key] = load_model(name, dtype, quiet=True)
        return _LOADED[key]

    return load


def unload_real_model(name: str, dtype: str = "fp32") -> None:
    """Drop a session-loaded model once the tests that need it are done (memory)."""
    _LOADED.pop((name, dtype), None)
