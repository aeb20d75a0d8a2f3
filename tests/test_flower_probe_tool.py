"""tools/flower_scaffold_probe.py: runs Flower's own NIID-Bench SCAFFOLD code (a checkout of adap/flower needed)."""

from pathlib import Path

import pytest
from conftest import load_script

TOOL = Path(__file__).resolve().parents[1] / "tools" / "flower_scaffold_probe.py"


def test_a_folder_without_flowers_niid_bench_is_named(tmp_path):
    pytest.importorskip("flwr")
    with pytest.raises(SystemExit, match=r"--flower .*: no baselines/niid_bench/niid_bench/client_scaffold.py"):
        load_script(TOOL, "flower_scaffold_probe").main(["--flower", str(tmp_path), "--rounds", "1"])
