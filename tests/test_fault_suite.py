"""benchmarks/fault_suite.py in CI: every careless-user probe it replays (bad flags and YAML, degenerate data, foreign
databases and files, damaged checkpoints and deleted records on resume, kill -9 then resume, workers outliving a
killed parent, ...) ends clean: a one-line error or a correct run, no traceback, no hang, nothing lost or wrong."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SUITE_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "fault_suite.py"


def _suite():
    spec = importlib.util.spec_from_file_location("fault_suite_under_test", SUITE_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


SUITE = _suite()


@pytest.mark.parametrize("case", SUITE.CASES, ids=lambda case: case.name)
def test_every_fault_case_ends_clean(tmp_path, case):
    """One test per case (so that parallel test workers share them out): a one-line error or a correct run."""
    outcome = SUITE.run_case(case, tmp_path)
    assert outcome.outcome == "clean", outcome


def test_the_suite_tallies_its_cases(tmp_path, capsys):
    names = [SUITE.CASES[0].name, SUITE.CASES[1].name]
    code = SUITE.main(["--only", ",".join(names), "--json", str(tmp_path / "faults.json"), "--verbose"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 cases: clean 2, traceback 0, hang 0, lost 0, wrong 0, unexpected 0" in out
    assert [o["case"] for o in json.loads((tmp_path / "faults.json").read_text())] == names


def test_the_suite_tells_a_traceback_a_hang_and_a_wrong_message_apart(tmp_path):
    suite = _suite()
    case = suite.Case("x", [], says="lr")
    assert suite.classify(case, None, "")[0] == "hang"
    assert suite.classify(case, 1, "Traceback (most recent call last):\n  ...\nValueError: x")[0] == "traceback"
    assert suite.classify(case, 2, "error: invalid configuration:\n  lr: must be > 0")[0] == "clean"
    assert suite.classify(case, 2, "error: invalid configuration:\n  clients: ...")[0] == "unexpected"
    assert suite.classify(case, 0, "")[0] == "unexpected"  # a run where an error was expected
    assert suite.classify(suite.Case("y", [], expect="ok"), 0, "")[0] == "clean"
