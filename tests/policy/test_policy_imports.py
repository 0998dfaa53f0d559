"""The policy side never imports torch (`polylane/policy/__init__.py`): checked in a fresh interpreter."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import polylane.policy

# Every module of the policy package and its subpackages, including ones added after this test.
POLICY_MODULES = tuple(
    sorted(info.name for info in pkgutil.walk_packages(polylane.policy.__path__, prefix="polylane.policy."))
)
PURE_MODULES = ("polylane", "polylane.types", "polylane.policy", *POLICY_MODULES)


HEAVY = ("torch", "transformers", "safetensors", "gguf")


def _heavy_modules_after_import(*modules: str, heavy: tuple[str, ...] = HEAVY) -> list[str]:
    """Import `modules` in a new interpreter; return the loaded modules of the `heavy` packages."""
    imports = "; ".join(f"import {module}" for module in modules)
    code = (
        f"import sys; {imports}; "
        f"print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {set(heavy)!r})))"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, f"import failed (exit {completed.returncode}):\n{completed.stderr}"
    return [name for name in completed.stdout.strip().split(",") if name]


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_does_not_import_torch(module: str) -> None:
    loaded = _heavy_modules_after_import(module)
    assert "torch" not in loaded, f"importing {module} loaded {len(loaded)} torch-side modules: {loaded[:8]}"
    assert not loaded, f"importing {module} loaded {len(loaded)} heavy modules: {loaded[:8]}"


def test_blocks_module_is_covered() -> None:
    assert "polylane.policy.kv.blocks" in POLICY_MODULES, f"policy modules found: {POLICY_MODULES}"


def test_all_pure_modules_together() -> None:
    loaded = _heavy_modules_after_import(*PURE_MODULES)
    assert not loaded, f"importing {PURE_MODULES} loaded {len(loaded)} heavy modules: {loaded[:8]}"


def test_the_check_can_fail() -> None:
    # The control: a module that is imported is seen, so an empty result above means something.
    loaded = _heavy_modules_after_import("polylane.policy", "json", heavy=("json",))
    assert "json" in loaded, f"the check did not see json imported: {loaded}"
