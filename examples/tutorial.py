"""A first hour with fedskew, as a script: heterogeneity, an honest comparison, and a personalized method.

Run it as it is (offline, the embedded 8x8 digits; about two minutes on a laptop) or smaller:

    python examples/tutorial.py                     # 20 rounds, 3 seeds
    python examples/tutorial.py --rounds 3 --seeds 1

1. **The federation.** 10 clients whose label mixes come from a Dirichlet(0.1) draw: most clients hold two or three
   classes. ``build_federated`` shows who holds what (the same seeded split every run below uses; on the command
   line: ``fedskew partition --clients 10 --alpha 0.1``).
2. **An honest comparison.** FedAvg, the same with uniform (unweighted) averaging as the control a re-weighting method
   must beat, FedDisco's weights on top of FedAvg (``fedavg+disco``) and FedProx: the same seeds and partition for
   every method, the mean and std over seeds, and each method's paired difference from FedAvg per seed.
3. **Personalization.** FedRoD keeps a personal head on each client: its ``personal`` view (each client's own model on
   its own test split) against its ``global_local`` view (the shared model on the same samples).

Every number is recomputed on each run; two runs of this script print the same table (``seed`` drives partitioning,
sampling, initialization and shuffling).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

import fedskew
from fedskew.api import build_federated
from fedskew.config import make_config


def mean_std(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.fmean(values):6.2f} ± {100 * sd:5.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seeds", type=int, default=3)
    a = p.parse_args()
    seeds = list(range(a.seeds))
    common = {"rounds": a.rounds, "clients": 10, "partition": "dir", "alpha": 0.1, "skew_probes": 0}

    # 1. the federation: training label counts per client (rows) and class (columns), as every run below splits it
    federation = build_federated(make_config(None, {**common, "seed": 0}))
    counts = np.asarray(federation.train_hists)
    print("1. training labels per client (Dirichlet 0.1, seed 0): class:count")
    for cid, row in enumerate(counts):
        held = ", ".join(f"{c}:{n}" for c, n in enumerate(row) if n)
        print(f"   client {cid}: {int(row.sum()):4d} samples  {held}")

    # 2. the same seeds and partition for every method; the global model's accuracy on the global test set
    methods = {
        "fedavg": ("fedavg", {}),
        "fedavg, uniform weights (control)": ("fedavg", {"weights": "uniform"}),
        "fedavg+disco": ("fedavg+disco", {}),
        "fedprox": ("fedprox", {}),
    }
    acc: dict[str, list[float]] = {}
    for label, (method, args) in methods.items():
        acc[label] = [
            fedskew.run(method, method_args=args, seed=s, **common).summary["global_acc"]["last_n_mean"] for s in seeds
        ]
    print(f"\n2. global accuracy (%), mean ± std over seeds {seeds}, last rounds' mean; Δ: paired, against fedavg")
    for label, values in acc.items():
        delta = [v - b for v, b in zip(values, acc["fedavg"], strict=True)]
        print(f"   {label:<36} {mean_std(values)}   Δ {100 * statistics.fmean(delta):+6.2f}")

    # 3. a personalized method: each client's own model against the shared one, on the clients' own test splits
    rod = [fedskew.run("fedrod", seed=s, **common).summary for s in seeds]
    personal = [r["personal_acc_mean"]["last_n_mean"] for r in rod]
    shared = [r["global_local_acc_mean"]["last_n_mean"] for r in rod]
    print("\n3. FedRoD, mean over clients of the accuracy on their own test splits (%)")
    print(f"   personal model (generic + personal head)  {mean_std(personal)}")
    print(f"   the shared (generic) model                {mean_std(shared)}")


if __name__ == "__main__":
    main()
