"""Several runs at once on one device (issue 27, item 2): the seeds of one experiment run one at a time, then N at a
time sharing the device (the local process pool, every worker on ``--device``), for each N of ``--jobs``; the
script prints runs per hour, the speed-up over one at a time, the best N, and whether the runs' metrics are the same
whatever N (they must be on a CPU; on CUDA they are as far as cuDNN's kernels are deterministic, and the script says
which). ``--stacked`` adds the same seeds run as rows of one stacked computation (``fedskew sweep --stack-seeds``,
one process, every run's clients trained by one batched step per round): its speed-up beside the concurrent levels,
and the largest difference of its metrics from the batched runs' (float32 rounding; it implies
``--batched-clients``).

A small model on a GPU leaves it mostly idle (a batch of 10 through PFLlib's CNN is a few microseconds of device
work per kernel and tens of microseconds of Python per step), so runs that share the device overlap their CPU work
with each other's kernels; the speed-up saturates when the device or the CPU cores are full. The workload is
``fedskew reproduce --scale small``'s shape: PFLlib's protocol, MNIST, Dir(0.1) over ``--clients`` clients, the CNN,
batch 10, 1 local epoch, ``--rounds`` rounds of ``--method``, ``--runs`` seeds (``--batched-clients`` optional).
Without ``--data-dir`` (or with ``--smoke``) the embedded digits and the MLP stand in, for a CPU check.

    python benchmarks/runs_per_gpu.py --data-dir ../shared/data/mnist --device cuda --jobs 1,2,4,8
    python benchmarks/runs_per_gpu.py --smoke --jobs 1,2                      # CI, CPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from sweep_scaling import metrics_of, one

from fedskew.sweep.core import SweepSpec


def max_difference(a: object, b: object) -> float:
    """The largest difference between two metric trees' numbers (``inf`` where their shapes or other values differ)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return max((max_difference(a[k], b[k]) for k in a), default=0.0) if a.keys() == b.keys() else float("inf")
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return float("inf")
        return max((max_difference(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b)
    return 0.0 if a == b else float("inf")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="MNIST folder (default: the embedded digits and the MLP)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--jobs", default="1,2,4,8", help="runs at a time to compare (1 is always measured first)")
    p.add_argument("--runs", type=int, default=8, help="seeds of the experiment (runs per measurement)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--method", default="fedavg")
    p.add_argument("--batched-clients", action="store_true", help="each run trains its clients batched")
    p.add_argument("--stacked", action="store_true", help="also the seeds as rows of one stacked computation")
    p.add_argument("--smoke", action="store_true", help="the embedded digits on the CPU, 2 rounds")
    p.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder)")
    args = p.parse_args(argv)
    levels = sorted({1, *(int(j) for j in args.jobs.split(","))})
    args.batched_clients = args.batched_clients or args.stacked  # stacked runs are batched runs: compare like with like
    if args.smoke:
        args.device, args.data_dir, args.rounds, args.clients = "cpu", None, 2, 10
    data = (
        {"dataset": "mnist", "data_dir": args.data_dir, "model": "cnn"}
        if args.data_dir
        else {"dataset": "digits", "model": "mlp"}
    )
    spec = SweepSpec(
        name="runs-per-gpu",
        base={**data, "protocol": "pfllib", "partition": "dir", "alpha": 0.1, "clients": args.clients,
              "rounds": args.rounds, "batch_size": 10, "local_epochs": 1, "lr": 0.005, "device": args.device,
              "skew_probes": 0, "threads": 1, "batched_clients": args.batched_clients, "eval_every": args.rounds},
        methods=[args.method],
        seeds=args.runs,
    )  # fmt: skip
    print(
        f"{args.runs} runs of {args.method} ({data['dataset']}, {data['model']}, {args.clients} clients, "
        f"{args.rounds} rounds, batched clients {'on' if args.batched_clients else 'off'}) on {args.device}",
        flush=True,
    )
    walls: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="fedskew-runs-per-gpu-") as tmp:
        base = Path(args.out) if args.out else Path(tmp)
        for jobs in levels:
            walls[jobs], _ = one(f"jobs{jobs}", spec, base / f"jobs{jobs}")
            rate = 3600 * args.runs / walls[jobs]
            print(
                f"jobs {jobs}: {args.runs} runs in {walls[jobs]:.1f} s, {rate:.0f} runs/hour, "
                f"speed-up {walls[1] / walls[jobs]:.2f}x over one at a time",
                flush=True,
            )
        metrics = {j: metrics_of(base / f"jobs{j}") for j in levels}
        if args.stacked:
            stacked_wall, _ = one("stacked", spec, base / "stacked")
            print(
                f"stacked: {args.runs} runs in {stacked_wall:.1f} s, {3600 * args.runs / stacked_wall:.0f} runs/hour, "
                f"speed-up {walls[1] / stacked_wall:.2f}x over one at a time",
                flush=True,
            )
            # float32 rounding of a step over more rows grows through training as batched against sequential does
            # (MNIST CNN, 2 rounds, measured: 1.3e-6 in the training loss, 5.7e-5 in an accuracy)
            diff = max_difference(metrics_of(base / "stacked"), metrics[1])
            print(f"stacked metrics: largest difference from the batched runs' {diff:.2e}")
    same = all(m == metrics[1] for m in metrics.values())
    best = min(walls, key=lambda j: walls[j])
    print(f"best: jobs {best} ({walls[1] / walls[best]:.2f}x over one at a time)")
    if args.stacked:
        print(f"best of concurrent and stacked: {'stacked' if stacked_wall < walls[best] else f'jobs {best}'}")
    print(f"metrics identical whatever the concurrency: {same}")
    return 0 if same or args.device != "cpu" else 1


if __name__ == "__main__":
    sys.exit(main())
