"""Evaluation cost per round: fedskew's evaluation now against its former settings, measured in one run.

Former: a fixed evaluation batch of 2048 and, under ``--protocol pfllib`` (where the global test set is the union of
the clients' test splits), a second pass over the same samples for ``global_acc``. Now: ``eval_batch_size: auto``
(the largest batch whose biggest layer output stays under 16 MiB on CPU, so the allocator reuses its buffers instead
of mapping fresh pages each batch) and every sample scored once per model. Both evaluate the same model on the same
data; the script alternates them ``--repeats`` times and prints seconds, minor page faults and the ratio.

    PYTHONPATH=src python benchmarks/eval_cost.py --data-dir ../shared/data/mnist        # PFLlib's MNIST workload
    PYTHONPATH=src python benchmarks/eval_cost.py                                         # digits (embedded)
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.engine.loop import Simulation


def timed(sim: Simulation) -> tuple[float, int]:
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = time.perf_counter()
    sim.evaluate()
    return time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="MNIST folder (default: the embedded digits)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    values = {"protocol": "pfllib", "partition": "dir", "alpha": 0.1, "clients": 20, "db": None, "model": "cnn"}
    if a.data_dir:
        values.update({"dataset": "mnist", "data_dir": a.data_dir})
    cfg = make_config(None, values)
    data = build_federated(cfg)
    now = Simulation(cfg, data)
    before = Simulation(cfg.model_copy(update={"eval_batch_size": 2048}), data)
    before.global_is_local_union = False  # the former second pass over the union
    print(
        f"{cfg.dataset}, protocol pfllib, {len(data.local_y)} client test samples, model {now.model_name}, "
        f"torch threads {torch.get_num_threads()}; auto eval batch {now.eval_batch}"
    )
    runs: dict[str, list[tuple[float, int]]] = {"before": [], "now": []}
    for _ in range(a.repeats):
        runs["before"].append(timed(before))
        runs["now"].append(timed(now))
    for name, rs in runs.items():
        seconds, faults = statistics.median(t for t, _ in rs), statistics.median(f for _, f in rs)
        print(f"{name:>6}: {seconds:.2f} s, {faults:,.0f} minor page faults")
    ratio = statistics.median(t for t, _ in runs["before"]) / statistics.median(t for t, _ in runs["now"])
    print(f"ratio before/now: {ratio:.2f}x")


if __name__ == "__main__":
    main()
