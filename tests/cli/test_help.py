"""`polylane --help` and the commands that need no model answer without importing torch (which
alone takes over a second to import); `bench/cli_start.py` times them."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import contextlib, io, sys
from polylane.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
print("torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["serve", "--help"], ["generate", "--help"], ["bench", "--help"], ["rm", "--help"]],
    ids=" ".join,
)
def test_help_does_not_import_torch(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False", f"{argv} imported torch"
