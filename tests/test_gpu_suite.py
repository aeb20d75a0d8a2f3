"""benchmarks/gpu_suite.py, the GPU run book, at toy size on the CPU (--smoke): every piece runs and reports its
figures, a second call skips what is done, and a call whose budget is spent leaves the rest for the next one. The
pieces are shared out over several tests (each its own suite folder, ``--only``), so parallel test workers run
them side by side; ``tests/test_gpu_suite_budget.py`` tests the budget's logic on a controlled clock."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SUITE = BENCH / "gpu_suite.py"
BATCHED = [f"batched-{m}" for m in ("fedavg", "fedprox", "scaffold", "feddyn", "moon", "fedntd", "fedgen")]
BATCHED += [f"batched-{m}" for m in ("fedala", "ditto", "fedbabu", "fedproto", "fedcac", "fedavg-vmap")]
BATCHED += [f"batched-{m}" for m in ("fedlc", "fedsam", "fedrod", "feddbe", "apfl", "perfedavg", "pfedme")]
BATCHED += [f"batched-{m}" for m in ("gpfl", "fedcp")]
BATCHED += [f"batched-{m}-captured" for m in ("fedavg", "fedprox", "scaffold", "fedlc", "fedsam", "fedrod")]
BATCHED += [f"batched-{m}-captured" for m in ("feddbe", "apfl", "moon", "fedntd", "fedproto", "perfedavg", "pfedme")]
BATCHED += [f"batched-{m}-captured" for m in ("fedgen", "gpfl", "fedcp")]
WHOLE_RUNS = ["pfl-batched", "pfl-captured", "pfl-sequential", "reproduce-feddisco", "host-ops", "methods-on-device"]
WHOLE_RUNS += ["methods-bf16", "methods-captured"]
WHOLE_RUNS += ["conv-forms", "pfl-forms", "env"]  # env: the matmul rate the pieces' arithmetic is a share of


def _suite(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SUITE), "--smoke", "--out", str(out), "--papers", "feddisco", "--rows", "fedavg", *args],
        capture_output=True, text=True, timeout=1500,
    )  # fmt: skip


def _results(out: Path, names: list[str]) -> dict[str, dict]:
    found = {name: json.loads((out / f"{name}.json").read_text()) for name in names}
    for name, result in found.items():
        assert result["ok"], (name, result)
    return found


def test_smoke_suite_leaves_what_does_not_fit_then_resumes(tmp_path):
    out = tmp_path / "suite"
    # a budget that fits nothing but the environment piece: the others are left for the next call
    first = _suite(out, "--budget", "5")
    assert first.returncode == 0, first.stderr
    assert "run the suite again" in first.stdout
    assert (out / "env.json").exists() and not (out / "batched-fedavg.json").exists()
    assert "**batched-fedavg**: not run yet" in (out / "suite.md").read_text()  # the report says what is missing

    # these pieces fit this call's budget on a slow or busy machine
    second = _suite(out, "--budget", "3000", "--only", "env,run100,runs-per-gpu,stacked-runs,stacked-vs-concurrent")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "env: done earlier, skipped" in second.stdout
    got = _results(out, ["run100", "runs-per-gpu", "stacked-runs", "stacked-vs-concurrent"])
    both = got["stacked-vs-concurrent"]  # batched runs 1 and 2 at a time, and stacked, on the same seeds
    assert sorted(both["speedup_by_jobs"]) == ["1", "2"] and both["stacked_speedup"] > 0 and both["identical"] is True
    assert got["stacked-runs"]["stacked_speedup"] > 0 and got["stacked-runs"]["stacked_max_difference"] < 1e-4
    assert got["run100"]["fraction_of_matmul_rate"] > 0  # the run's arithmetic against the env piece's matmul rate
    shared = got["runs-per-gpu"]
    assert sorted(shared["speedup_by_jobs"]) == ["1", "2"] and shared["identical"] is True
    assert shared["best_jobs"] in (1, 2)
    assert "**runs-per-gpu**: {" in (out / "suite.md").read_text()

    third = _suite(out, "--only", "env,run100")
    assert third.returncode == 0 and third.stdout.count("done earlier, skipped") == 2


@pytest.mark.parametrize("part", [BATCHED[0::3], BATCHED[1::3], BATCHED[2::3]], ids=["a", "b", "c"])
def test_smoke_suite_runs_the_batched_pieces(tmp_path, part):
    out = tmp_path / "suite"
    done = _suite(out, "--budget", "3000", "--only", ",".join(part))
    assert done.returncode == 0, done.stderr[-3000:]
    for name, batched in _results(out, part).items():
        # exact equivalence is tests/test_batched_clients.py's (1e-5 on every tensor); this workload's random images
        # amplify float32 rounding: FedProto's 3.0e-3 here is exactly what the sequential loop moves by when its
        # received model moves by one ulp (batched_clients.py --noise-floor, measured), so the bound is 1e-2
        assert batched["speedup"] > 0 and batched["max_error"] < 1e-2, (name, batched)
    if "batched-fedavg-vmap" in part:
        assert "batched step vmap" in json.loads((out / "batched-fedavg-vmap.json").read_text())["workload"]
    for name in (n for n in part if n.endswith("-captured")):
        assert "batched step captured" in json.loads((out / f"{name}.json").read_text())["workload"]


def test_smoke_suite_runs_the_whole_run_pieces(tmp_path):
    out = tmp_path / "suite"
    done = _suite(out, "--budget", "3000", "--only", ",".join(WHOLE_RUNS))
    assert done.returncode == 0, done.stderr[-3000:]
    pfl = _results(out, WHOLE_RUNS)["pfl-batched"]
    assert pfl["rounds"] == 3 and 0 <= pfl["global_acc"]["final"] <= 1
    assert (out / "reproduce" / "feddisco" / "table.md").exists()
    report = (out / "suite.md").read_text()
    assert "pfl-research workload: 3 rounds batched" in report
    assert "pfl-research workload with --capture-steps: 3 rounds" in report
    host = _results(out, ["host-ops"])["host-ops"]  # the round's dispatches outside and inside the steps
    assert host["ops_outside_steps"] > 0 and host["ops_inside_steps"] > 0 and host["by_function"]
    methods = _results(out, ["methods-on-device"])["methods-on-device"]  # 4 methods, sequential and batched
    assert methods["runs"] == 8 and methods["ok_runs"] == 8 and methods["failed"] == []
    bf16 = _results(out, ["methods-bf16"])["methods-bf16"]  # the same under bfloat16 autocast
    assert bf16["runs"] == 8 and bf16["ok_runs"] == 8 and bf16["failed"] == []
    captured = _results(out, ["methods-captured"])["methods-captured"]  # GPFL's and FedCP's heads' stacked forms
    assert captured["runs"] == 3 and captured["ok_runs"] == 3 and captured["refused_runs"] == 0
    forms = _results(out, ["conv-forms"])["conv-forms"]["speed_over_grouped"]  # on a CPU: no TF32, no cuDNN
    assert list(forms) == ["K 3, TF32 off"]
    assert set(forms["K 3, TF32 off"]) == {
        "grouped",
        "grouped+channels_last",
        "unfold+bmm",
        "loop",
        "grouped+bf16",
        "unfold+bmm+bf16",
    }
    assert forms["K 3, TF32 off"]["grouped"] == 1.0
    layers = _results(out, ["conv-forms"])["conv-forms"]["per_layer_speed_over_grouped"]["K 3, TF32 off"]
    assert sorted(layers) == ["layer 1", "layer 2"] and set(layers["layer 2"]) == set(forms["K 3, TF32 off"])
    assert layers["layer 1"]["grouped"] == 1.0
    captured = _results(out, ["pfl-captured"])["pfl-captured"]
    assert captured["global_acc"]["final"] == pytest.approx(pfl["global_acc"]["final"], abs=0.02)  # the same training
    forms = _results(out, ["pfl-forms"])["pfl-forms"]  # every kernel variant ran, and the fastest ran again
    variants = forms["variants"]
    kinds = {"grouped", "grouped-tf32", "grouped-bench", "grouped-nhwc", "unfold-tf32", "per-client"}
    assert set(variants) == kinds | {"per-layer", "grouped-bf16", "unfold-bf16"}
    assert variants["grouped"]["speed_over_first"] == 1.0 and forms["best"] in variants
    assert all(v["rounds"] == 3 and v["median_round_ms"] > 0 for v in variants.values())
    accs = [v["final_acc"] for v in variants.values()]  # the same training, up to float32 rounding
    assert max(accs) - min(accs) <= 0.02
    assert forms["best_run"]["rounds"] == 3 and "pfl-research workload with the fastest" in report
    assert forms["best_run"]["gflop_per_round"] > 0 and forms["best_run"]["fraction_of_matmul_rate"] > 0
    env = json.loads((out / "env.json").read_text())
    assert env["matmul_gflops"] > 0 and env["matmul_gflops_bf16"] > 0
    bf16_best = "bf16" in variants[forms["best"]]["settings"]  # a bf16 best run's arithmetic against the bf16 rate too
    assert ("fraction_of_bf16_matmul_rate" in forms["best_run"]) == bf16_best


@pytest.mark.xdist_group("ray")  # Flower's Simulation Engine starts a local Ray cluster (conftest, pyproject)
@pytest.mark.skipif(
    importlib.util.find_spec("flwr") is None or importlib.util.find_spec("ray") is None,
    reason='Flower\'s Simulation Engine is not installed (pip install -e ".[flower-sim]")',
)
def test_smoke_suite_runs_fedskew_beside_flowers_simulation_engine(tmp_path):
    out = tmp_path / "suite"
    done = _suite(out, "--budget", "3000", "--only", "vs-flower")
    assert done.returncode == 0, done.stderr[-3000:]
    got = _results(out, ["vs-flower"])["vs-flower"]
    with_pfl = importlib.util.find_spec("pfl") is not None  # the [pfl] extra, which CI installs
    assert set(got["sides"]) == {"flower", "sequential", "batched", "captured"} | ({"pfl"} if with_pfl else set())
    assert got["not_run"] == ({} if with_pfl else {"pfl": "pfl is not installed (the [pfl] extra: pip install pfl)"})
    for side, fig in got["sides"].items():
        assert 0 <= fig["final_acc"] <= 1 and fig["steady_round_s"] > 0 and fig["fraction_of_matmul_rate"] > 0, side
    # fedskew's two paths train the same clients the same way: the same accuracy (to float32 rounding)
    for side in ("batched", "captured"):
        assert abs(got["sides"]["sequential"]["final_acc"] - got["sides"][side]["final_acc"]) < 0.02, side
    assert got["sides"]["batched"]["vs_flower"] > 0 and got["train_gflop_round"] > 0
    report = (out / "suite.md").read_text()
    assert "fedskew vs Flower's Simulation Engine (steady round time): sequential" in report
    assert ("fedskew vs pfl-research's simulator (steady round time): sequential" in report) == with_pfl


@pytest.mark.skipif(importlib.util.find_spec("pfl") is None, reason="pfl-research is not installed (the [pfl] extra)")
def test_pfl_research_side_trains_the_workload_like_fedskew(tmp_path):
    """benchmarks/vs_flower_sim.py's pfl side: pfl's FedAvg on the same clients reaches fedskew's accuracy after the
    same rounds with every client in every round (no sampling difference; each side initializes its own model), and
    its figures and ratio are written."""
    figs = tmp_path / "figs.json"
    argv = [sys.executable, str(BENCH / "vs_flower_sim.py"), "--clients", "10", "--per-round", "10", "--rounds", "10"]
    argv += ["--device", "cpu", "--skip", "flower,batched,captured", "--json", str(figs)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(figs.read_text())
    assert set(got["sides"]) == {"pfl", "sequential"} and got["not_run"] == {}
    pfl, seq = got["sides"]["pfl"], got["sides"]["sequential"]
    assert pfl["steady_round_s"] > 0 and seq["vs_pfl"] > 0
    # 10 rounds (measured: pfl 83.01, fedskew 82.17; after 4 rounds the two initializations still differ by 10 points)
    assert seq["final_acc"] > 0.7 and abs(pfl["final_acc"] - seq["final_acc"]) < 0.05
    assert "fedskew sequential vs pfl:" in done.stdout


def test_pfl_forms_reports_a_failed_variant_and_still_measures_the_others(tmp_path, monkeypatch, capsys):
    """A variant whose run fails (a flag this version refuses, here) is named with its error; the others run, the
    fastest of them runs again, the figures are written, and the exit status says one failed."""
    sys.path.insert(0, str(BENCH))
    try:
        import pfl_forms
    finally:
        sys.path.remove(str(BENCH))
    monkeypatch.setattr(pfl_forms, "VARIANTS", {"grouped": [], "broken": ["--stacked-conv", "im2col"]})
    figs = tmp_path / "f.json"
    argv = ["--device", "cpu", "--smoke", "--out", str(tmp_path / "runs"), "--json", str(figs)]
    assert pfl_forms.main(argv) == 1
    printed = capsys.readouterr().out
    assert "broken        FAILED [--stacked-conv im2col]: exit 2" in printed and "fastest: grouped" in printed
    got = json.loads(figs.read_text())
    assert "stacked_conv" in got["variants"]["broken"]["error"] and got["best"] == "grouped"
    assert got["best_run"]["rounds"] == 3 and got["variants"]["grouped"]["speed_over_first"] == 1.0
    # a second call reads the finished runs instead of running them again
    before = (tmp_path / "runs" / "grouped" / "metrics.jsonl").stat().st_mtime_ns
    assert pfl_forms.main([*argv, "--variants", "grouped"]) == 0
    assert (tmp_path / "runs" / "grouped" / "metrics.jsonl").stat().st_mtime_ns == before


def test_pfl_forms_does_not_choose_a_faster_variant_that_learns_worse(capsys):
    """The fastest variant is chosen among those within the tolerance of grouped's accuracy (bf16's faster arithmetic
    counts only if it learns as well); without grouped, every variant that ran may be chosen."""
    sys.path.insert(0, str(BENCH))
    try:
        import pfl_forms
    finally:
        sys.path.remove(str(BENCH))
    found = {
        "grouped": {"final_acc": 0.9000, "median_round_ms": 30.0},
        "grouped-bf16": {"final_acc": 0.8940, "median_round_ms": 10.0},  # 0.6 points below: not chosen
        "unfold-bf16": {"final_acc": 0.8960, "median_round_ms": 20.0},  # 0.4 below: chosen
    }
    assert pfl_forms._eligible(found, list(found), 0.5) == ["grouped", "unfold-bf16"]
    assert "grouped's" in found["grouped-bf16"]["not_chosen"] and "not_chosen" not in found["unfold-bf16"]
    assert "grouped-bf16  not chosen: accuracy 89.40" in capsys.readouterr().out
    assert pfl_forms._eligible(found, ["grouped-bf16", "unfold-bf16"], 0.5) == ["grouped-bf16", "unfold-bf16"]
