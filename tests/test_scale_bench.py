"""benchmarks/scale.py at CI size: it runs FedAvg and Ditto, reports a fixed cost per client against a plain loop of
the same steps, and the disk store keeps Ditto's personal models out of RAM."""

import json
import subprocess
import sys
from pathlib import Path

SCALE = Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py"


def test_scale_benchmark_small(tmp_path):
    out = tmp_path / "scale.json"
    args = ["--clients", "300", "--rounds", "3", "--per-round", "20", "--eval-clients", "10", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(SCALE), *args, "--state-store", "disk"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["method"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"fedavg", "ditto"}
    for r in results.values():
        assert r["clients"] == 300 and r["per_round"] == 20 and r["backend"] == "disk"
        assert r["train_s"] > 0 and r["plain_s"] > 0 and r["peak_mb"] > 0
        assert r["fixed_ms"] == (r["train_s"] - r["plain_s"]) * 1e3 / r["per_round"]
    assert results["ditto"]["state_mb"] > 0  # personal models written to the store
    assert results["ditto"]["eval_clients"] == 10  # the one timed evaluation scored a sample
    assert "fixed/client" in proc.stdout and list(tmp_path.iterdir()) == [out]  # nothing written beside it
