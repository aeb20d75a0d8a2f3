"""benchmarks/gpu_suite.py, the GPU run book, at toy size on the CPU (--smoke): every piece runs and reports its
figures, a second call skips what is done, and a call whose budget is spent leaves the rest for the next one."""

import json
import subprocess
import sys
from pathlib import Path

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"


def _suite(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SUITE), "--smoke", "--out", str(out), *args],
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip


def test_smoke_suite_runs_every_piece_then_resumes(tmp_path):
    out = tmp_path / "suite"
    # a budget that fits nothing but the environment piece: the others are left for the next call
    first = _suite(out, "--budget", "5", "--papers", "feddisco", "--rows", "fedavg")
    assert first.returncode == 0, first.stderr
    assert "run the suite again" in first.stdout
    assert (out / "env.json").exists() and not (out / "batched-fedavg.json").exists()

    # every piece fits this call's budget on a slow or busy machine: the budget's logic is the first call's test
    second = _suite(out, "--budget", "3000", "--papers", "feddisco", "--rows", "fedavg")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "env: done earlier, skipped" in second.stdout
    names = [f"batched-{m}" for m in ("fedavg", "fedprox", "scaffold", "feddyn", "moon", "fedntd", "fedgen")]
    names += [f"batched-{m}" for m in ("fedala", "ditto", "fedbabu", "fedproto", "fedcac", "fedavg-vmap")]
    names += ["pfl-batched"]
    names += ["pfl-sequential", "run100", "runs-per-gpu", "reproduce-feddisco"]
    for name in names:
        result = json.loads((out / f"{name}.json").read_text())
        assert result["ok"], (name, result)
    for name in [n for n in names if n.startswith("batched-")]:
        batched = json.loads((out / f"{name}.json").read_text())
        # exact equivalence is tests/test_batched_clients.py's (1e-5 on every tensor); this workload's random images
        # amplify float32 rounding: FedProto's 3.0e-3 here is exactly what the sequential loop moves by when its
        # received model moves by one ulp (batched_clients.py --noise-floor, measured), so the bound is 1e-2
        assert batched["speedup"] > 0 and batched["max_error"] < 1e-2, (name, batched)
    assert "batched step vmap" in json.loads((out / "batched-fedavg-vmap.json").read_text())["workload"]
    shared = json.loads((out / "runs-per-gpu.json").read_text())
    assert sorted(shared["speedup_by_jobs"]) == ["1", "2"] and shared["identical"] is True
    assert shared["best_jobs"] in (1, 2)
    pfl = json.loads((out / "pfl-batched.json").read_text())
    assert pfl["rounds"] == 3 and 0 <= pfl["global_acc"]["final"] <= 1
    assert (out / "reproduce" / "feddisco" / "table.md").exists()
    report = (out / "suite.md").read_text()
    assert "pfl-research workload: 3 rounds batched" in report and "not run yet" not in report

    third = _suite(out, "--only", "env,run100")
    assert third.returncode == 0 and third.stdout.count("done earlier, skipped") == 2
