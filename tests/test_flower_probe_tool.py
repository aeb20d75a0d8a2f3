"""tools/flower_scaffold_probe.py: runs Flower's own NIID-Bench SCAFFOLD code (a checkout of adap/flower needed)."""

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "flower_scaffold_probe.py"


def _tool():
    spec = importlib.util.spec_from_file_location("flower_scaffold_probe", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_folder_without_flowers_niid_bench_is_named(tmp_path):
    pytest.importorskip("flwr")
    with pytest.raises(SystemExit, match=r"--flower .*: no baselines/niid_bench/niid_bench/client_scaffold.py"):
        _tool().main(["--flower", str(tmp_path), "--rounds", "1"])
