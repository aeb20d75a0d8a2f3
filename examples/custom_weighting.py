"""A new server weighting in a few lines, composed with FedProx and compared with FedAvg, uniform FedAvg and FedDisco.

The idea tested: weight each client's model by the inverse of its local training loss. Every run goes into one
database and `fedskew report` (here its library form) prints mean ± std over seeds, one row per method.

Run: python examples/custom_weighting.py [--rounds 20] [--seeds 3] [--db runs/weighting.db]
"""

import argparse

import fedskew
from fedskew.results.report import report_from_db
from fedskew.results.store import ResultsDB


@fedskew.weighting("invloss")
def inverse_loss(rin, params):
    """weights ∝ 1 / local training loss"""
    return 1.0 / rin.metrics["train_loss"].clamp_min(1e-8)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--db", default="runs/weighting.db")
    args = parser.parse_args()
    runs = [("fedavg", {}), ("fedavg", {"weights": "uniform"}), ("fedprox+disco", {}), ("fedprox+invloss", {})]
    for seed in range(args.seeds):
        for method, margs in runs:  # the embedded digits, Dir(0.1) over 10 clients
            fedskew.run(method, method_args=margs, rounds=args.rounds, seed=seed, db=args.db)
    with ResultsDB(args.db) as db:
        print(report_from_db(db, ["global_acc"]).render("markdown"))
