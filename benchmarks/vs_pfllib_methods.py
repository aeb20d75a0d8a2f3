"""Accuracy side by side: each personalized method as PFLlib implements it and as fedskew does, on PFLlib's own clients.

Workload: MNIST, PFLlib's 20-client Dir(0.1) split (its ``generate_MNIST.py noniid - dir``), its CNN, batch 10,
lr 0.005, 1 local epoch, full participation, ``--rounds`` rounds (a few: PFLlib's code is run unmodified, one thread
each). Both tools read the same dataset folder (fedskew: ``--dataset npz --partition given --protocol pfllib``).
PFLlib seeds torch with 0 at import and leaves Python's and NumPy's generators unseeded (its client order, hence
which client draws which shuffles, varies from run to run: ``--pfllib-host-seed`` seeds them), so its run is one
draw; ``--pfllib-seeds`` varies its torch seed. fedskew runs ``--seeds`` seeds (initialization and shuffling; the
split is PFLlib's), and the table prints PFLlib's accuracy after the last round beside fedskew's mean ±
std and whether PFLlib's lies within fedskew's range widened by one std. PFLlib's figure is its "Averaged Test
Accuracy" (correct over samples, all clients' test splits pooled, at the start of the next round: the models the
clients hold then; for FedAS, whose server sends nothing before it evaluates, the models they just trained), i.e.
fedskew's ``personal_acc`` (``trained_acc`` for APFL, whose PFLlib figure mixes in the model just
trained; ``global_local_acc`` for FedAvg, for LG-FedAvg, whose clients keep their bodies without a model of their own,
and for pFedMe, whose PFLlib evaluation reads the global model: docs/methods.md).

Pairs (fedskew arguments ↔ PFLlib arguments) follow each method's defaults in fedskew's docs/methods.md; where PFLlib's
defaults differ the PFLlib side is given fedskew's value (FedDBE ``-mo 1 -klw 50``, FedCP ``-lam 5``, GPFL ``-lam 0.01
-mu 0.1``: the official scripts'; APFL ``-al 0.5``; pFedMe ``-lam 15 -K 5 -lrp 0.01 -bt 1``, the paper's, and the
fedskew side ``mu=0.001``, the value PFLlib's pFedMeOptimizer always applies), and
Per-FedAvg's fedskew side takes PFLlib's layout (batches of 2B split in halves: ``--batch-size 20``; ``train()`` twice
a round: ``--local-epochs 2``). PFLlib's loaders drop each epoch's last partial batch; fedskew keeps it unless
``--drop-last`` is given (then every fedskew run gets ``fedskew run --drop-last``, and its figures are recorded under
their own key).

    python benchmarks/vs_pfllib_methods.py --pfllib PFLlib --mnist-idx ../shared/data/mnist --rounds 3

needs PFLlib's run-time imports beside fedskew's (``ujson``, ``h5py``, ``calmsize``, and ``cvxpy`` for PFLlib's FedPAC;
torchvision is stood in for by ``pfllib_shim.py``, which raises if a run needed it). ``--out FILE`` writes the figures
as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHIM = HERE / "pfllib_shim.py"
sys.path.insert(0, str(HERE))

from vs_pfllib import generate_pfllib_mnist  # noqa: E402

# fedskew method (and arguments) -> (fedskew's view that PFLlib's figure reads, PFLlib's arguments)
PAIRS: dict[str, tuple[list[str], str, list[str]]] = {
    "fedavg": (["--method", "fedavg"], "global_local_acc", ["-algo", "FedAvg"]),
    "fedrod": (["--method", "fedrod"], "personal_acc", ["-algo", "FedROD"]),
    "feddbe": (["--method", "feddbe"], "personal_acc", ["-algo", "FedDBE", "-mo", "1", "-klw", "50"]),
    # PFLlib evaluates v̄ = αv + (1−α)w with the w just trained, before aggregation: fedskew's trained_ view
    "apfl": (["--method", "apfl", "-m", "alpha=0.5"], "trained_acc", ["-algo", "APFL", "-al", "0.5"]),
    "perfedavg": (
        ["--method", "perfedavg", "--batch-size", "20", "--local-epochs", "2"],
        "personal_acc",
        ["-algo", "PerAvg"],
    ),
    "pfedme": (  # mu 0.001: PFLlib's pFedMeOptimizer default, which its client always uses (args.mu is not passed)
        ["--method", "pfedme", "-m", "mu=0.001"],
        "global_local_acc",
        ["-algo", "pFedMe", "-lam", "15", "-K", "5", "-lrp", "0.01", "-bt", "1"],
    ),
    "lgfedavg": (["--method", "lgfedavg"], "global_local_acc", ["-algo", "LG-FedAvg"]),  # local bodies: no own model
    "fedpac": (["--method", "fedpac"], "personal_acc", ["-algo", "FedPAC", "-lam", "1"]),
    "fedas": (["--method", "fedas"], "personal_acc", ["-algo", "FedAS"]),
    "fedcp": (["--method", "fedcp"], "personal_acc", ["-algo", "FedCP", "-lam", "5"]),
    "gpfl": (["--method", "gpfl"], "personal_acc", ["-algo", "GPFL", "-lam", "0.01", "-mu", "0.1"]),
    # PFLlib holds out the last 20% of each client's training split for FedFomo's weights (its val_ratio)
    "fedfomo": (["--method", "fedfomo", "--validation", "0.2"], "personal_acc", ["-algo", "FedFomo", "-M", "5"]),
}
COMMON_PFLLIB = ["-data", "MNIST", "-m", "CNN", "-nc", "20", "-lbs", "10", "-lr", "0.005", "-ls", "1", "-jr", "1"]


def one_thread() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def pfllib_accuracy(
    pfllib: Path, args: list[str], rounds: int, seed: int = 0, host_seeded: bool = False
) -> list[float]:
    """PFLlib's "Averaged Test Accuracy" at each evaluation (round 0 = the initial model, then after each round);
    ``seed``: what PFLlib's ``torch.manual_seed(0)`` calls seed (``pfllib_shim.py --torch-seed``; 0: as it is);
    ``host_seeded``: Python's and NumPy's generators seeded with ``seed`` too (``--host-seed``), else left unseeded
    as PFLlib leaves them (its client order, hence each client's shuffles, then varies from run to run)."""
    host = ["--host-seed", str(seed)] if host_seeded else []
    shim = [sys.executable, str(SHIM), "--torch-seed", str(seed), *host, "main.py"]
    cmd = [*shim, *COMMON_PFLLIB, *args, "-gr", str(rounds), "-eg", "1", "-dev", "cpu"]
    run = subprocess.run(cmd, cwd=pfllib / "system", env=one_thread(), capture_output=True, text=True)
    accs = [float(a) for a in re.findall(r"Averaged Test Accuracy: ([0-9.]+)", run.stdout)]
    if len(accs) < rounds + 1:  # pFedMe reports its evaluations through print_: "Average Test Accuracy"
        accs = [float(a) for a in re.findall(r"Average Test Accuracy: ([0-9.]+)", run.stdout)]
    # PFLlib's FedAS trains and evaluates every round, then fails in its closing report (it calls a missing
    # avg_generalization_metrics): the evaluations it printed are complete, so they count
    if len(accs) < rounds + 1:
        raise RuntimeError(f"PFLlib {' '.join(args)} failed ({run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}")
    return accs


def fedskew_accuracy(data: Path, args: list[str], view: str, rounds: int, seed: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "fedskew.cli", "run", "--dataset", "npz", "--data-dir", str(data),
            "--partition", "given", "--protocol", "pfllib", "--model", "cnn", "--clients", "20",
            "--rounds", str(rounds), "--batch-size", "10", "--lr", "0.005", "--local-epochs", "1",
            "--threads", "1", "--seed", str(seed), "--out", f"{tmp}/run", "--no-db", "--quiet", *args,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True, env=one_thread())
        last = [json.loads(s) for s in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()][-1]
    views = ("global_local_acc", "personal_acc", "trained_acc")
    return {k: float(last[k]) for k in views if k in last} | {"view": last[view]}


_CACHE_LOCK = threading.Lock()


def _cached(cache: Path | None, key: str, compute: Callable[[], Any], needs: str | None = None) -> Any:
    """``compute()``, or what an earlier call of this script recorded under ``key`` in ``cache`` (a JSON file: each
    figure is written as soon as it is measured, so a stopped or failed call loses nothing); ``needs``: a key the
    recorded figures must hold (a view an earlier version of this script did not record), else they are measured
    again."""
    with _CACHE_LOCK:
        data = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    if key in data and (needs is None or needs in data[key]):
        return data[key]
    value = compute()
    if cache is not None:
        with _CACHE_LOCK:  # the runs finish in other threads: one read-modify-write at a time
            data = json.loads(cache.read_text()) if cache.is_file() else {}
            data[key] = value
            cache.write_text(json.dumps(data, indent=1))
    return value


def _attempt(compute: Callable[[], Any]) -> Any:
    """``compute()``, or ``{"error": ...}``: one failed run is reported in its row, never stops the others."""
    try:
        return compute()
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        tail = getattr(exc, "stderr", None) or str(exc)
        return {"error": f"{type(exc).__name__}: {str(tail)[-1500:]}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pfllib", type=Path, required=True, help="a PFLlib checkout")
    p.add_argument("--mnist-idx", type=Path, help="official MNIST IDX files: write PFLlib's dataset folder with them")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument(
        "--pfllib-seeds", type=int, default=1, help="PFLlib runs with torch seeds 0, 1, ... (pfllib_shim --torch-seed)"
    )
    p.add_argument(
        "--pfllib-host-seed",
        action="store_true",
        help="seed PFLlib's Python and NumPy generators with its torch seed (pfllib_shim --host-seed): repeatable runs",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    p.add_argument("--methods", nargs="*", default=list(PAIRS), choices=list(PAIRS))
    p.add_argument("--out", type=Path, help="the figures as JSON, written as each is measured (and reused)")
    p.add_argument(
        "--drop-last",
        action="store_true",
        help="fedskew drops each local epoch's last partial batch, as PFLlib's loaders do (fedskew run --drop-last)",
    )
    a = p.parse_args()
    data = a.pfllib / "dataset" / "MNIST"
    if not (data / "config.json").is_file():
        if a.mnist_idx is None:
            sys.exit(f"{data} has no PFLlib dataset: run PFLlib's generate_MNIST.py noniid - dir, or pass --mnist-idx")
        generate_pfllib_mnist(a.pfllib, a.mnist_idx)
    jobs = {}
    with ThreadPoolExecutor(a.jobs) as pool:
        for m in a.methods:
            fed_args, view, pfl_args = PAIRS[m]
            fed_args = [*fed_args, "--drop-last"] if a.drop_last else fed_args
            # the key names the arguments too: a figure measured with other settings is never read back as this one
            key = f"{m} r{a.rounds} {' '.join(fed_args)}".rstrip()
            pfl_key = f"{m} r{a.rounds} {' '.join(pfl_args)}"
            for t in range(a.pfllib_seeds):  # seed 0's key as before this option (its recorded figures stay valid)
                measure_pfllib = lambda pa=pfl_args, t=t: pfllib_accuracy(  # noqa: E731
                    a.pfllib, pa, a.rounds, t, a.pfllib_host_seed
                )
                name = f"{pfl_key} pfllib{f' t{t}' if t else ''}{' host-seeded' if a.pfllib_host_seed else ''}"
                jobs[(m, "pfllib", t)] = pool.submit(_attempt, lambda k=name, f=measure_pfllib: _cached(a.out, k, f))
            for s in range(a.seeds):
                jobs[(m, s)] = pool.submit(
                    _attempt,
                    lambda k=key, fa=fed_args, v=view, s=s: _cached(
                        a.out, f"{k} fedskew s{s}", lambda: fedskew_accuracy(data, fa, v, a.rounds, s), needs=v
                    ),
                )
        print(
            f"MNIST, PFLlib's 20-client Dir(0.1) split, CNN, {a.rounds} rounds, {a.pfllib_seeds} PFLlib torch seeds, "
            f"{a.seeds} fedskew seeds" + (" (fedskew with --drop-last)" if a.drop_last else "")
        )
        print(f"{'method':<10} {'PFLlib mean ± std':>20} {'fedskew mean ± std':>20} {'overlap':>8}  fedskew view")
        for m in a.methods:
            pfl = [jobs[(m, "pfllib", t)].result() for t in range(a.pfllib_seeds)]
            ours = [jobs[(m, s)].result() for s in range(a.seeds)]
            failed = [r["error"] for r in [*pfl, *ours] if isinstance(r, dict) and "error" in r]
            if failed:
                print(f"{m:<10} failed: {failed[0][-300:]}")
                continue
            theirs = [r[a.rounds] for r in pfl]
            views = [r[PAIRS[m][1]] for r in ours]
            (pm, ps), (mean, std) = spread(theirs), spread(views)
            # each side's range widened by its std: do they meet? (one PFLlib seed: its value in fedskew's)
            inside = min(theirs) - ps <= max(views) + std and min(views) - std <= max(theirs) + ps
            verdict = "yes" if inside else "NO"
            row = f"{100 * pm:>11.2f} ± {100 * ps:.2f}% {100 * mean:>11.2f} ± {100 * std:.2f}% {verdict:>8}"
            print(f"{m:<10} {row}  {PAIRS[m][1]}")


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample std (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


if __name__ == "__main__":
    main()
