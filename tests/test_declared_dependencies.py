"""Every third-party module that src/, tests/ and bench/ import is declared in pyproject.toml.

A module installed by hand on one machine makes the suite pass there and fail on a fresh one
(`scipy` once did). This walks every import statement (ast), maps each top-level module to the
distributions that provide it (`importlib.metadata.packages_distributions`), and fails naming any
module whose distribution is neither declared (dependencies or an extra) nor installed as a
dependency of a declared one. A module that is not installed here (an extra's, such as
`llama_cpp`) must match a declared distribution by name.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
import tomllib
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
SCANNED = ("src", "tests", "bench")
LOCAL = {"polylane", "tests", "bench", "conftest"}


def _distribution_name(requirement: str) -> str:
    """'ray[serve]>=2.40' → 'ray' (normalised: lower case, '-' for '_' and '.')."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0]).lower()


def declared_distributions(pyproject: Path) -> set[str]:
    """The distributions pyproject.toml declares, with everything they require when installed."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    pending = [_distribution_name(r) for r in requirements]
    closure: set[str] = set()
    while pending:
        name = pending.pop()
        if name in closure:
            continue
        closure.add(name)
        try:
            required = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        pending += [_distribution_name(r) for r in required if "extra ==" not in r]
    return closure


def imported_modules(roots: list[Path]) -> dict[str, set[str]]:
    """Top-level module → the files that import it (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for root in roots:
        for path in root.rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(root.parent)))
    return found


def undeclared_modules(pyproject: Path, roots: list[Path]) -> dict[str, set[str]]:
    declared = declared_distributions(pyproject)
    providers = metadata.packages_distributions()
    missing = {}
    for module, files in imported_modules(roots).items():
        if module in sys.stdlib_module_names or module in LOCAL or module.startswith("_"):
            continue
        distributions = {_distribution_name(d) for d in providers.get(module, [])}
        if distributions:
            if distributions & declared:
                continue
        elif any(name.startswith(_distribution_name(module)) for name in declared):
            continue  # not installed here, declared under its own name (an extra's module)
        missing[module] = files
    return missing


def test_every_imported_module_is_declared() -> None:
    missing = undeclared_modules(REPOSITORY / "pyproject.toml", [REPOSITORY / r for r in SCANNED])
    lines = [
        f"{module} (imported in {', '.join(sorted(files)[:3])})" for module, files in sorted(missing.items())
    ]
    assert not missing, "imported but not declared in pyproject.toml: " + "; ".join(lines)


def test_an_undeclared_module_is_named(tmp_path: Path) -> None:
    """The check fails on what it is for: scipy imported, pyproject without it."""
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["numpy>=1.26"]\n')
    source = tmp_path / "src"
    source.mkdir()
    (source / "uses.py").write_text("import numpy\nfrom scipy import stats\nimport json\n")
    missing = undeclared_modules(pyproject, [source])
    assert missing == {"scipy": {"src/uses.py"}}, missing
    pyproject.write_text(
        '[project]\nname = "x"\ndependencies = ["numpy>=1.26"]\n'
        '[project.optional-dependencies]\ntest = ["scipy>=1.11"]\n'
    )
    assert undeclared_modules(pyproject, [source]) == {}
