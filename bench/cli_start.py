"""How long `polylane --help` and `polylane serve --help` take to answer, against a bare Python start.

Run:  python bench/cli_start.py [--repeats 7]

Each command runs in a fresh process (`python -m polylane.cli ...`), median wall time of --repeats
runs, after one warm-up run each; "python" is `python -c pass`, the floor any command pays. Prints
a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python": [sys.executable, "-c", "pass"],
    "polylane --help": [sys.executable, "-m", "polylane.cli", "--help"],
    "polylane serve --help": [sys.executable, "-m", "polylane.cli", "serve", "--help"],
}


def seconds(command: list[str], repeats: int) -> float:
    subprocess.run(command, capture_output=True, check=True)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    results = {name: seconds(command, args.repeats) for name, command in COMMANDS.items()}
    print("| command | median s |\n|---|---|")
    for name, value in results.items():
        print(f"| {name} | {value:.3f} |")
    print(json.dumps({"repeats": args.repeats, "seconds": results}))


if __name__ == "__main__":
    main()
