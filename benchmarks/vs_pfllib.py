"""fedskew against PFLlib, side by side, on PFLlib's own clients (a PFLlib checkout you provide; nothing is vendored).

Workload (issue 15): MNIST, PFLlib's 20-client Dir(0.1) split, its CNN, batch 10, lr 0.005, 1 local epoch, evaluation
every round. Both tools read the same files: PFLlib's dataset folder (``dataset/MNIST/{train,test}/*.npz`` and
``config.json``, written by PFLlib's ``generate_MNIST.py``), which fedskew reads with
``--dataset npz --partition given --protocol pfllib``. The runs alternate (PFLlib, fedskew, PFLlib, ...) so that drift
of the machine hits both, and the script prints the median seconds per round of each and their ratio, for the
thread settings asked:

* ``--threads 0``: the whole machine: PFLlib with torch's default threads, fedskew with ``--workers N`` processes of
  one thread each (``--workers`` default: the number of cores);
* ``--threads 1``: one thread each (``OMP_NUM_THREADS=1`` for PFLlib, ``--threads 1 --workers 1`` for fedskew).

PFLlib's per-round time is its own ``time cost`` line (select, send, evaluate, train, receive, aggregate); fedskew's is
``time_round`` of ``metrics.jsonl`` (train, aggregate, evaluate). PFLlib skips its first round in its average; so does
this script for both. Setup, with PFLlib's requirements installed:

    git clone https://github.com/TsingZ0/PFLlib && (cd PFLlib/dataset && python generate_MNIST.py noniid - dir)
    python benchmarks/vs_pfllib.py --pfllib PFLlib --rounds 5 --threads 0 --threads 1

Without torchvision (the CPU torch build here has none) or the network, ``--mnist-idx DIR`` (the official MNIST IDX
files) has PFLlib's own ``generate_MNIST.py`` write the dataset folder, unmodified, through ``pfllib_shim.py``, which
also stands in for the packages PFLlib's ``main.py`` imports but its FedAvg/CNN path never uses (torchvision, cvxpy;
a stand-in raises if used). PFLlib's code runs as it is in both cases.
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
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "pfllib_shim.py"


def generate_pfllib_mnist(pfllib: Path, mnist_idx: Path) -> None:
    """PFLlib's own ``dataset/generate_MNIST.py noniid - dir`` (its seeds, Dir(0.1), 20 clients, 75/25 splits), fed
    the local IDX files through the shim instead of torchvision's download."""
    idx = str(mnist_idx.resolve())
    cmd = [sys.executable, str(SHIM), "--mnist-idx", idx, "generate_MNIST.py", "noniid", "-", "dir"]
    subprocess.run(cmd, cwd=pfllib / "dataset", check=True, capture_output=True, text=True)


def pfllib_round_times(pfllib: Path, rounds: int, clients: int, threads: int, device: str) -> list[float]:
    env = dict(os.environ)
    if threads:
        env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
    cmd = [
        sys.executable, str(SHIM), "main.py", "-data", "MNIST", "-m", "CNN", "-algo", "FedAvg", "-gr", str(rounds),
        "-nc", str(clients), "-lbs", "10", "-lr", "0.005", "-ls", "1", "-jr", "1", "-eg", "1", "-dev", device,
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=pfllib / "system", env=env, capture_output=True, text=True, check=True).stdout
    times = [float(t) for t in re.findall(r"time cost -+ ([0-9.]+)", out)]
    if not times:
        raise RuntimeError(f"no 'time cost' lines in PFLlib's output:\n{out[-2000:]}")
    return times[1:]  # PFLlib's own average skips round 0


def fedskew_round_times(
    data: Path, rounds: int, clients: int, threads: int, workers: int, device: str, extra: list[str]
) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "fedskew.cli", "run", "--dataset", "npz", "--data-dir", str(data),
            "--partition", "given", "--protocol", "pfllib", "--model", "cnn", "--clients", str(clients),
            "--rounds", str(rounds + 1), "--batch-size", "10", "--lr", "0.005", "--local-epochs", "1",
            "--threads", str(threads), "--workers", str(workers), "--device", device,
            "--out", f"{tmp}/run", "--no-db", "--quiet", *extra,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        lines = [json.loads(s) for s in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
    return [r["time_round"] for r in lines][1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pfllib", required=True, type=Path, help="a PFLlib checkout with dataset/MNIST generated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2, help="alternating runs of each tool per setting")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--threads", type=int, action="append", default=None, help="0: whole machine; repeatable")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="fedskew workers at --threads 0")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--fedskew-flag", action="append", default=None, help="extra `fedskew run` flag (default: --channels-last)"
    )
    p.add_argument("--mnist-idx", type=Path, help="official MNIST IDX files: generate PFLlib's dataset from them")
    args = p.parse_args()
    data = args.pfllib / "dataset" / "MNIST"
    if not (data / "config.json").is_file():
        if args.mnist_idx is None:
            raise SystemExit(f"{data}/config.json missing: run PFLlib's dataset/generate_MNIST.py or pass --mnist-idx")
        generate_pfllib_mnist(args.pfllib, args.mnist_idx)
    extra = ["--channels-last"] if args.fedskew_flag is None else [f for f in args.fedskew_flag if f]
    print(f"fedskew flags: {' '.join(extra) or '(none)'}")
    for threads in args.threads or [0, 1]:
        workers = args.workers if threads == 0 else 1
        ours, theirs = [], []
        for _ in range(args.repeats):
            theirs += pfllib_round_times(args.pfllib, args.rounds, args.clients, threads, args.device)
            ours += fedskew_round_times(data, args.rounds, args.clients, max(threads, 1), workers, args.device, extra)
        t_p, t_f = statistics.median(theirs), statistics.median(ours)
        label = "whole machine" if threads == 0 else f"{threads} thread(s)"
        print(
            f"{label}: PFLlib {t_p:.2f} s/round, fedskew {t_f:.2f} s/round (workers {workers}); "
            f"ratio PFLlib/fedskew {t_p / t_f:.2f}"
        )


if __name__ == "__main__":
    main()
