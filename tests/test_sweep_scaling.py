"""benchmarks/sweep_scaling.py at CI size: the same sweep with --jobs 1, --jobs 2 and (when Ray is installed) the Ray
executor gives identical metrics, and the script prints runs per hour for each."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "sweep_scaling.py"


@pytest.mark.xdist_group("ray")  # one local Ray cluster at a time
def test_sweep_scaling_small(tmp_path):
    kinds = "jobs1,jobs2" + (",ray" if importlib.util.find_spec("ray") is not None else "")
    argv = ["--rounds", "2", "--seeds", "1", "--methods", "fedavg,fedprox", "--kinds", kinds, "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "metrics identical across executors: True" in proc.stdout
    for kind in kinds.split(","):
        assert f"{kind:6} 2 runs in" in proc.stdout
        assert len(list((tmp_path / kind / "runs").glob("*/metrics.jsonl"))) == 2
