"""tools/fingerprint.py, the refactoring check of issue 32: the same code gives the same fingerprints, a changed
number is reported, and a refused composition is recorded with its reason."""

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "fingerprint.py"


def _tool():
    spec = importlib.util.spec_from_file_location("fingerprint_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fingerprints_repeat_and_a_changed_number_is_reported(tmp_path, monkeypatch, capsys, one_thread):
    tool = _tool()
    monkeypatch.setitem(tool.SETTINGS, "rounds", 2)
    names = ["fedavg+disco", "scaffold+cloud"]
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert tool.main(["--out", str(first), "--only", *names]) == 0
    prints = json.loads(first.read_text())
    assert len(prints["fedavg+disco"]) == 64 and prints["scaffold+cloud"].startswith("refused:")
    assert tool.main(["--out", str(second), "--only", *names, "--compare", str(first)]) == 0
    assert "2 identical, 0 differ" in capsys.readouterr().out
    prints["fedavg+disco"] = "0" * 64  # as if a refactor had moved one number
    first.write_text(json.dumps(prints))
    assert tool.main(["--out", str(second), "--only", *names, "--compare", str(first)]) == 1
    assert "DIFFERS fedavg+disco" in capsys.readouterr().out


def test_the_composition_list_covers_every_part():
    from fedskew.methods import CLIENTS, SERVER_PLUGINS

    names = _tool().compositions()
    assert len(names) == len(set(names))
    assert set(CLIENTS) <= set(names) and {f"fedavg+{p}" for p in SERVER_PLUGINS} <= set(names)
