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


def test_fedskew_methods_imports_no_heavy_library():
    """`fedskew methods` prints from catalog/index.json (fedskew/method_index.py), importing no method."""
    assert _loaded([["methods"]]) == []


def test_the_method_index_is_the_registrys():
    """catalog/index.json is what the registry gives now (after changing a part: python tools/method_index.py)."""
    import json

    from fedskew.method_index import INDEX, compute_index

    stored = json.loads(INDEX.read_text(encoding="utf-8"))
    assert stored == compute_index(), "catalog/index.json is stale: run python tools/method_index.py"


def test_one_line_errors_still_reach_the_user_from_lazily_imported_modules(tmp_path, capsys):
    from fedskew.cli import main

    assert main(["run", "--rounds", "0", "--out", str(tmp_path / "r")]) == 2  # a ConfigError
    assert main(["report", "--db", str(tmp_path / "none.db")]) == 2  # a DatabaseError (no such database)
    err = capsys.readouterr().err
    assert err.count("error: ") == 2 and "Traceback" not in err
    assert "none.db: `fedskew run` (or sweep, reproduce) records each run there" in err  # says how to get one


def test_a_part_registered_in_this_process_is_listed(capsys, monkeypatch):
    from fedskew import registry
    from fedskew.cli import main
    from fedskew.methods import resolve_method

    resolve_method("fedavg", {})  # the built-in catalog is registered
    part = registry.ServerPlugin(
        "listed_here", "registered at run time", "test", registry.NoParams, ("weighting",), lambda p: {}
    )
    monkeypatch.setitem(registry.SERVER_PLUGINS, "listed_here", part)
    assert main(["methods"]) == 0
    assert "listed_here" in capsys.readouterr().out
