"""benchmarks/fault_suite.py in CI: every careless-user probe it replays (bad flags and YAML, degenerate data, foreign
databases and files, damaged checkpoints and deleted records on resume, kill -9 then resume, workers outliving a
killed parent, ...) ends clean: a one-line error or a correct run, no traceback, no hang, nothing lost or wrong."""

import importlib.util
import sys
from pathlib import Path

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "fault_suite.py"


def _suite():
    spec = importlib.util.spec_from_file_location("fault_suite_under_test", SUITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_fault_case_ends_clean(tmp_path, capsys):
    suite = _suite()
    code = suite.main(["--json", str(tmp_path / "faults.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"{len(suite.CASES)} cases: clean {len(suite.CASES)}, traceback 0, hang 0, lost 0, wrong 0" in out


def test_the_suite_tells_a_traceback_a_hang_and_a_wrong_message_apart(tmp_path):
    suite = _suite()
    case = suite.Case("x", [], says="lr")
    assert suite.classify(case, None, "")[0] == "hang"
    assert suite.classify(case, 1, "Traceback (most recent call last):\n  ...\nValueError: x")[0] == "traceback"
    assert suite.classify(case, 2, "error: invalid configuration:\n  lr: must be > 0")[0] == "clean"
    assert suite.classify(case, 2, "error: invalid configuration:\n  clients: ...")[0] == "unexpected"
    assert suite.classify(case, 0, "")[0] == "unexpected"  # a run where an error was expected
    assert suite.classify(suite.Case("y", [], expect="ok"), 0, "")[0] == "clean"
