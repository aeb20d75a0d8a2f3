"""The GPU run book's budget and resumption (benchmarks/gpu_suite.py) on a clock the test controls: every piece "takes"
the time the test gives it, one is slowed far past its estimate, and what each call runs, defers and kills follows
from the budget alone. Nothing here reads the machine's clock, so a slow or busy machine cannot change the outcome
(tests/test_gpu_suite.py runs the real pieces)."""

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
from conftest import load_script

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"
ONLY = "env,batched-fedavg,batched-fedprox,pfl-batched,run100,runs-per-gpu"  # smoke estimates 1, 20, 20, 20, 20, 30


def _load_suite(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_suite_under_test", SUITE)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def suite(monkeypatch):
    module = _load_suite(monkeypatch)
    clock = {"now": 0.0, "ran": [], "limits": {}, "takes": {}}

    class FakeTime:
        @staticmethod
        def perf_counter():
            return clock["now"]

    def run_piece(piece, out):
        """A piece that takes ``takes[name]`` seconds of the test's clock (its estimate unless slowed); killed at
        its limit as the real one is."""
        took = clock["takes"].get(piece.name, piece.estimate_s)
        clock["ran"].append(piece.name)
        clock["limits"][piece.name] = piece.limit_s
        if took > piece.limit_s:
            clock["now"] += piece.limit_s
            return {"piece": piece.name, "ok": False, "error": f"timed out after {piece.limit_s:.0f}s"}
        clock["now"] += took
        return {"piece": piece.name, "ok": True, "seconds": took}

    monkeypatch.setattr(module, "time", FakeTime)
    monkeypatch.setattr(module, "run_piece", run_piece)

    def call(out, budget, takes=None):
        clock.update(now=0.0, ran=[], limits={}, takes=takes or {})
        code = module.main(["--smoke", "--out", str(out), "--only", ONLY, "--budget", str(budget)])
        return code, list(clock["ran"]), dict(clock["limits"])

    return call


def _done(out):
    return sorted(p.stem for p in out.glob("*.json") if json.loads(p.read_text()).get("ok"))


def test_a_slowed_piece_defers_the_pieces_that_no_longer_fit_and_the_next_call_runs_them(suite, tmp_path, capsys):
    out = tmp_path / "suite"
    # 111 s of estimates in a 111 s budget; batched-fedavg takes 70 s instead of 20: 50 s of the others' time is gone
    code, ran, limits = suite(out, 111, takes={"batched-fedavg": 70})
    assert code == 0
    # env (1) + fedavg (70) + fedprox (20) = 91; 20 s left: pfl-batched (20) fits, run100 and runs-per-gpu do not
    assert ran == ["env", "batched-fedavg", "batched-fedprox", "pfl-batched"]
    assert limits["batched-fedavg"] == 110  # a piece is never given more than the budget left (111 - env's 1)
    printed = capsys.readouterr().out
    assert "run100: needs ~20s, 0s left: run the suite again" in printed
    assert "runs-per-gpu: needs ~30s, 0s left: run the suite again" in printed
    assert _done(out) == ["batched-fedavg", "batched-fedprox", "env", "pfl-batched"]
    report = (out / "suite.md").read_text()
    assert "**run100**: not run yet" in report and "**runs-per-gpu**: not run yet" in report

    # the next call skips what is done and runs exactly what was left, whatever the first call's clock said
    code, ran, _ = suite(out, 60)
    assert code == 0 and ran == ["run100", "runs-per-gpu"]
    assert _done(out) == ["batched-fedavg", "batched-fedprox", "env", "pfl-batched", "run100", "runs-per-gpu"]
    assert "not run yet" not in (out / "suite.md").read_text()
    code, ran, _ = suite(out, 1)  # a third call has nothing to do
    assert code == 0 and ran == []


def test_a_piece_slower_than_the_budget_left_is_cut_at_it_and_run_again_next_time(suite, tmp_path, capsys):
    out = tmp_path / "suite"
    # batched-fedprox hangs (1,000 s): it is cut where the call's budget ends, reported failed, the rest deferred
    code, ran, limits = suite(out, 60, takes={"batched-fedprox": 1000})
    assert code == 1 and ran == ["env", "batched-fedavg", "batched-fedprox"]
    assert limits["batched-fedprox"] == 39  # 60 - 1 - 20
    assert json.loads((out / "batched-fedprox.json").read_text())["error"] == "timed out after 39s"
    assert "batched-fedprox: FAILED" in capsys.readouterr().out
    # a failed piece is not a result: the next call runs it again, then what did not fit before
    code, ran, _ = suite(out, 200)
    assert code == 0 and ran == ["batched-fedprox", "pfl-batched", "run100", "runs-per-gpu"]
    assert json.loads((out / "batched-fedprox.json").read_text())["ok"]


def test_a_batched_pieces_figures_are_read_from_its_output(monkeypatch):
    suite = _load_suite(monkeypatch)
    # the lines batched_clients.py printed on the H200 (docs/measured/gpu-h200-2026-12-04/batched-fedavg-captured.log)
    # and the busy share from the kernels' own times, which it prints on a GPU since
    out = (
        "MNIST data: 100 clients, 52456 training samples (per client 32..3261), model cnn, method fedavg, batch 10\n"
        "arithmetic: 1342.981 GFLOP of training; dense fp32 matmul on the device: 47029 GFLOP/s\n"
        "repeat 1: sequential 7.666s (cpu 7.168s) | batched 0.476s (cpu 0.478s) | speedup 16.10x | max |difference| "
        "2.59e-04 (8/100 clients > 1e-5) | GPU utilization (batched) mean 65%, max 90%\n"
        "\nspeedup batched/sequential: 16.03x (median; sequential 7.740s, batched 0.483s)\n"
        "max equivalence error: 2.59e-04 (every run, warm-up included)\n"
        "fraction of the matmul rate: batched 5.93%, sequential 0.37% (2780.5 and 173.5 GFLOP/s)\n"
        "device busy (batched, kernels' own times, one profiled round): 71% of the batched time (0.343s of kernels, "
        "copies and memsets)\n"
    )
    piece = suite.Piece("batched-fedavg-captured", [], 45, 240)
    got = suite.figures(piece, out)
    assert got["speedup"] == 16.03 and got["sequential_s"] == 7.74 and got["batched_s"] == 0.483
    assert got["max_error"] == 2.59e-4 and got["fraction_of_matmul_rate"] == pytest.approx(0.0593)
    assert got["utilization"] == "mean 65%, max 90%"
    assert got["kernel_busy"] == "71% of the batched time (0.343s of kernels, copies and memsets)"
    off = out.replace(got["kernel_busy"], "unavailable (the profiler recorded no device activity)")
    assert suite.figures(piece, off.replace(", one profiled round): ", "): "))["kernel_busy"].startswith("unavailable")


def test_the_host_ops_figures_are_read_from_its_output(monkeypatch):
    suite = _load_suite(monkeypatch)
    # the lines host_ops.py printed on the H200 (docs/measured/gpu-h200-2026-12-04b/host-ops.log), then the device's
    # own times, which it prints on a GPU since
    out = (
        "workload: mnist, 1000 clients, 0.05 a round, cnn, fedavg, batch 10, 1 epoch, captured steps, device cuda\n"
        "operations a round outside the steps: 1019 (inside the steps' bodies: 0, one graph replay a step on a GPU)\n"
        "  (the profiler recorded no Python frames of fedskew under torch 2.11.0+cu130: not attributed)\n"
        "round time (unprofiled, median of 5): 28.7 ms\n"
        "device busy (one profiled round, kernels' own times): 21.4 ms, 75% of\n"
        "the unprofiled round; the device's work by kernel (share of the kernels' summed time):\n"
        "      9.12 ms   41%  x480    void cudnn::cnn::wgrad2d_grouped_direct_kernel<float>\n"
        "      4.00 ms   18%  x960    sm90_xmma_gemm_f32f32\n"
    )
    got = suite.figures(suite.Piece("host-ops", [], 40, 180), out)
    assert got["ops_outside_steps"] == 1019 and got["ops_inside_steps"] == 0 and got["round_ms"] == 28.7
    assert got["by_function"] == []  # nothing attributed: no line of counts
    assert got["device_busy_ms"] == 21.4 and got["device_busy_share"] == 0.75
    assert got["top_kernels"][0] == ("9.12", "void cudnn::cnn::wgrad2d_grouped_direct_kernel<float>")
    assert len(got["top_kernels"]) == 2


def test_a_method_that_fails_on_the_device_is_named_and_fails_the_check(monkeypatch, capsys):
    bench = load_script(SUITE.parent / "methods_on_device.py", "methods_on_device_under_test")
    cuda_error = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"

    def run(cfg, **kwargs):
        if cfg.method == "feddbe":
            raise RuntimeError(cuda_error)
        return types.SimpleNamespace(summary={"global_acc": {"final": 0.5}})

    monkeypatch.setattr(bench, "run_experiment", run)
    monkeypatch.setattr(sys, "argv", ["methods_on_device.py", "--device", "cpu", "--methods", "fedavg,feddbe"])
    assert bench.main() == 1
    out = capsys.readouterr().out
    assert "methods on cpu: 2 ok, 0 refused, 2 failed of 4 runs" in out
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 2 and all(
        "feddbe" in line and "RuntimeError: Expected all tensors" in line for line in failed
    )
    # the run book keeps which methods failed, though the piece exited 1
    suite = _load_suite(monkeypatch)
    got = suite.figures(suite.Piece("methods-on-device", [], 150, 400), out)
    assert got["failed"] == ["feddbe sequential", "feddbe batched"] and got["failed_runs"] == 2 and got["runs"] == 4
    # every registered method is in the default list, a plug-in tied to its client part with that part
    names = bench.all_methods()
    assert {"fedavg", "feddbe", "fedfomo", "fedavg+ccvr", "fedavg+heal"} <= set(names)
    assert "fedavg+cloud" not in names and "fedavg+fomo" not in names


def test_the_convolution_forms_speeds_are_read_per_workload(monkeypatch):
    suite = _load_suite(monkeypatch)
    out = (
        "PFLlib CNN's convolutions, forward + backward, batch 10, cuda (torch 2.11.0+cu130)\n"
        "K 50, TF32 off:\n"
        "  grouped                2.000 ms    1.00x grouped's speed  max diff 0.0e+00\n"
        "  grouped+benchmark      1.000 ms    2.00x grouped's speed  max diff 0.0e+00\n"
        "  unfold+bmm             4.000 ms    0.50x grouped's speed  max diff 1.5e-05\n"
        "K 50, TF32 on:\n"
        "  grouped                1.000 ms    1.00x grouped's speed  max diff 0.0e+00\n"
        "  loop                  10.000 ms    0.10x grouped's speed  max diff 0.0e+00\n"
    )
    got = suite.figures(suite.Piece("conv-forms", [], 40, 180), out)["speed_over_grouped"]
    assert got == {
        "K 50, TF32 off": {"grouped": 1.0, "grouped+benchmark": 2.0, "unfold+bmm": 0.5},
        "K 50, TF32 on": {"grouped": 1.0, "loop": 0.1},
    }


def test_a_method_run_on_the_device_writes_only_its_own_folder(tmp_path):
    bench = load_script(SUITE.parent / "methods_on_device.py", "methods_on_device_writes")
    status, detail = bench.run_one("fedavg", "sequential", "cpu", 1, tmp_path / "out")
    assert status == "ok" and detail.startswith("accuracy"), detail
    assert (tmp_path / "out" / "summary.json").exists()
    assert not (Path.cwd() / "runs").exists()  # no results database in the working directory (conftest: tmp_path)
