"""Runs per hour of one sweep, three ways in one process: ``--jobs 1``, ``--jobs 2`` (the local process pool) and the
Ray executor on a local Ray instance of 2 CPUs (``--executor ray`` without ``--address``), each into its own folder.

The sweep: the embedded digits, Dir(0.1) over ``--clients`` clients, the methods of ``--methods`` × ``--seeds``
seeds, ``--rounds`` rounds each (default 4 methods × 3 seeds = 12 runs). Each executor starts from nothing (its own
run directories and database); the script prints wall time, runs per hour and the ratios against ``--jobs 1`` and
``--jobs 2``, and checks that the three sweeps' metrics are identical apart from timing (the executors change where
a run happens, never what it computes). The goal of issue 26: Ray / local pool ≥ 0.9 on one machine. The order of
the three is rotated with ``--rotate`` so that machine drift does not always hit the same one.

    python benchmarks/sweep_scaling.py                       # 12 runs of 20 rounds each way
    python benchmarks/sweep_scaling.py --rounds 2 --seeds 1  # a quick check
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from fedskew.protocol import TIMING_KEYS
from fedskew.sweep.core import SweepSpec, expand, run_sweep


def metrics_of(root: Path) -> dict[str, list[dict]]:
    out = {}
    for f in sorted(root.glob("runs/*/metrics.jsonl")):
        lines = f.read_text().splitlines()
        out[f.parent.name] = [{k: v for k, v in json.loads(s).items() if k not in TIMING_KEYS} for s in lines]
    return out


def one(kind: str, spec: SweepSpec, root: Path, address: str | None = None) -> tuple[float, int]:
    runs = expand(spec, out=root / "runs", db=root / "fedskew.db")
    executor = None
    jobs = 1
    stack = kind == "stacked"  # the seeds as rows of one stacked computation (sweep --stack-seeds), one process
    if kind.startswith("jobs"):  # jobsN: the local pool with N processes
        jobs = int(kind.removeprefix("jobs"))
    elif kind == "ray":
        from fedskew.sweep.ray import RayExecutor, check_ray

        check_ray()
        executor = RayExecutor(address=address, jobs=2)
    t0 = time.perf_counter()
    outcome = run_sweep(runs, jobs=jobs, executor=executor, stack_seeds=stack)
    wall = time.perf_counter() - t0
    failed = [r for r in outcome.results if r.status not in ("finished", "skipped")]
    if failed:
        raise SystemExit(f"{kind}: runs failed: {[(r.name, r.status, r.error) for r in failed]}")
    return wall, len(runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="fedavg,fedprox,scaffold,fedavg+disco")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--kinds", default="jobs1,jobs2,ray", help="which executors (jobsN: the pool of N; ray)")
    p.add_argument("--rotate", type=int, default=0, help="start the order at this position")
    p.add_argument("--out", default=None, help="keep the sweeps here (default: a temporary folder)")
    p.add_argument(
        "--address",
        default=None,
        help="run the Ray sweep on this running Ray instance (ray start --head --num-cpus 2) instead of starting one",
    )
    args = p.parse_args(argv)
    spec = SweepSpec(
        name="sweep-scaling",
        base={"dataset": "digits", "partition": "dir", "alpha": 0.1, "clients": args.clients, "rounds": args.rounds,
              "model": "mlp", "skew_probes": 0, "threads": 1},
        methods=args.methods.split(","),
        seeds=args.seeds,
    )  # fmt: skip
    kinds = args.kinds.split(",")
    kinds = kinds[args.rotate % len(kinds) :] + kinds[: args.rotate % len(kinds)]
    with tempfile.TemporaryDirectory(prefix="fedskew-sweep-scaling-") as tmp:
        base = Path(args.out) if args.out else Path(tmp)
        walls: dict[str, float] = {}
        for kind in kinds:
            wall, n = one(kind, spec, base / kind, args.address)
            walls[kind] = wall
            print(f"{kind:6} {n} runs in {wall:7.1f} s: {3600 * n / wall:8.0f} runs/hour", flush=True)
        metrics = {k: metrics_of(base / k) for k in kinds}
        same = all(m == metrics[kinds[0]] for m in metrics.values())
    print(f"metrics identical across executors: {same}")
    if "jobs1" in walls:
        for k in kinds:
            if k != "jobs1":
                print(f"speed-up {k} / jobs1: {walls['jobs1'] / walls[k]:.2f}x")
    if "ray" in walls and "jobs2" in walls:
        print(f"Ray / local pool (2 CPUs each): {walls['jobs2'] / walls['ray']:.2f} (goal >= 0.9)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
