"""How long each command takes to answer ``--help`` (its start-up: imports and the parser), against a reference
measured in the same run: a bare ``python -c pass``, and ``import torch`` (what a command pays once it trains).

    python benchmarks/cli_startup.py [--repeats 5]

Prints, per command, the median wall time of ``python -m fedskew.cli COMMAND --help`` and its ratio to the bare
interpreter and to the torch import. Commands should stay near the interpreter's own start-up: the heavy
libraries (torch, scipy, Flower, Ray, Optuna) load inside the commands that use them (tests/test_cli_startup.py).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def _median_time(cmd: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    from fedskew.cli import build_parser

    commands = sorted(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    bare = _median_time([sys.executable, "-c", "pass"], a.repeats)
    torch_import = _median_time([sys.executable, "-c", "import torch"], a.repeats)
    print(f"reference: python -c pass {bare:.3f} s; python -c 'import torch' {torch_import:.3f} s")
    print(f"{'command':<12} {'--help s':>9} {'× bare':>8} {'× torch import':>15}")
    for command in ["(none)", *commands]:
        argv = ["--help"] if command == "(none)" else [command, "--help"]
        t = _median_time([sys.executable, "-m", "fedskew.cli", *argv], a.repeats)
        print(f"{command:<12} {t:9.3f} {t / bare:8.2f} {t / torch_import:15.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
