"""Commands answer at once (issue 45): building the CLI's parser, and every ``--help``, import none of the heavy
libraries (torch, scipy, Flower, Ray, Optuna); those load inside the commands that use them."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "scipy", "flwr", "ray", "optuna", "matplotlib", "sklearn")
PROBE = """
import contextlib, io, sys
{setup}
from fedskew.cli import build_parser, main
build_parser()
for argv in {argvs!r}:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
print("LOADED:" + ",".join(m for m in {heavy!r} if m in sys.modules))
"""


def _loaded(argvs: list[list[str]], setup: str = "") -> list[str]:
    code = PROBE.format(argvs=argvs, heavy=HEAVY, setup=setup)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("LOADED:"))
    return [m for m in line[len("LOADED:") :].split(",") if m]


def test_the_parser_and_every_help_import_no_heavy_library():
    from fedskew.cli import build_parser

    commands = sorted(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert {"run", "methods", "sweep", "tune", "report"} <= set(commands)
    assert _loaded([["--help"]] + [[c, "--help"] for c in commands]) == []


def test_the_probe_sees_a_heavy_import():
    """The check is not vacuous: a heavy module imported before the commands is reported."""
    assert _loaded([["--help"]], setup="import fedskew.protocol") == ["torch"]
