"""Checkpoint overhead: the time spent writing resumable checkpoints, as a share of the run's time.

For each setting the script runs the same federation twice in this process, alternating: with ``checkpoint_every=1``
(a checkpoint after every round: the worst case) and with the default ``checkpoint_every=auto`` (a checkpoint when the
rounds since the last one took 49 times its writing time, so writing stays under 2% of the run). It prints the mean
time of one checkpoint, its size, the mean round time, and the overhead of each policy (checkpoint time / wall time).
Settings: FedAvg on digits (a small model, cheap rounds: the hardest case for the ratio), Ditto and FedCAC on digits
(a model per client in the checkpoint), and, with ``--data-dir``, FedAvg with the PFLlib CNN on MNIST, 20 clients.

    PYTHONPATH=src python benchmarks/checkpoint_overhead.py --quick
    PYTHONPATH=src python benchmarks/checkpoint_overhead.py --data-dir ../shared/data/mnist
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from fedskew.config import make_config
from fedskew.runner import run_experiment


def settings(data_dir: str | None, rounds: int) -> list[tuple[str, dict]]:
    base = {"rounds": rounds, "skew_probes": 0, "db": None, "threads": 1}
    out = [
        ("fedavg, digits MLP, 10 clients", {**base, "clients": 10}),
        ("ditto, digits MLP, 20 clients", {**base, "clients": 20, "method": "ditto"}),
        ("fedcac, digits lenet_bn, 20 clients", {**base, "clients": 20, "method": "fedcac", "model": "lenet_bn"}),
    ]
    if data_dir:
        out.append(
            (
                "fedavg, MNIST CNN, 20 clients",
                {**base, "clients": 20, "dataset": "mnist", "data_dir": data_dir, "rounds": max(2, rounds // 5)},
            )
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="MNIST folder for the CNN setting (optional)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="10 rounds")
    a = p.parse_args()
    rounds = 10 if a.quick else a.rounds
    print(f"{'setting':<38} {'ckpt ms':>8} {'ckpt MB':>8} {'round ms':>9} {'every=1':>8} {'auto':>8} {'#auto':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, values) in enumerate(settings(a.data_dir, rounds)):
            res = {}
            for policy in (1, "auto"):
                out = Path(tmp) / f"setting{i}-{policy}"
                cfg = make_config(None, {**values, "checkpoint_every": policy, "out": str(out)})
                sizes: list[int] = []

                def size(result, out=out, sizes=sizes) -> None:
                    ck = out / "checkpoint.pt"
                    if ck.is_file():
                        sizes.append(ck.stat().st_size)

                summary = run_experiment(cfg, on_round=size).summary
                res[policy] = (summary, max(sizes, default=0))
            s1, size1 = res[1]
            sa, _ = res["auto"]
            per_ckpt = s1["checkpoint_time"] / max(s1["checkpoints"], 1)
            round_ms = 1000 * s1["mean_time_round"]
            print(
                f"{label:<38} {1000 * per_ckpt:8.1f} {size1 / 2**20:8.2f} {round_ms:9.1f} "
                f"{100 * s1['checkpoint_time'] / s1['wall_time']:7.2f}% "
                f"{100 * sa['checkpoint_time'] / sa['wall_time']:7.2f}% {sa['checkpoints']:6d}"
            )
    print(json.dumps({"note": "every=1 / auto: checkpoint time as a share of the run's wall time"}))


if __name__ == "__main__":
    main()
