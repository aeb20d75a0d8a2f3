"""Compare methods on one setting over several seeds: same partition and seeds for every method, runs in parallel
processes, results in one SQLite database, then the markdown report (mean ± std over seeds).

    python benchmarks/compare.py --methods fedavg,fedavg:weights=uniform,fedsa --seeds 0,1,2 --jobs 3 \\
        --db runs/compare.db -- --dataset mnist --data-dir ../shared/data/mnist --clients 20 --rounds 50

A method entry is NAME[:KEY=VALUE[:KEY=VALUE...]] (method hyper-parameters). Everything after ``--`` is passed to
every ``fedskew run``. Include ``fedavg:weights=uniform`` as the control whenever a server method is compared with
FedAvg: part of some methods' gain is a weighting effect.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_args(entry: str, seed: int, db: str, out_root: Path, common: list[str]) -> list[str]:
    name, *kvs = entry.split(":")
    tag = entry.replace(":", "_").replace("=", "-").replace("+", "_")
    args = [
        sys.executable,
        "-m",
        "fedskew.cli",
        "run",
        "--method",
        name,
        "--seed",
        str(seed),
        "--db",
        db,
        "--out",
        str(out_root / f"{tag}-s{seed}"),
        "--quiet",
        "--overwrite",
    ]
    for kv in kvs:
        args += ["-m", kv]
    return args + common


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", required=True)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--db", default="runs/compare.db")
    p.add_argument("--out-root", default="runs/compare")
    p.add_argument("--metric", action="append", default=None, help="report metric(s); default global_acc")
    p.add_argument("common", nargs=argparse.REMAINDER)
    a = p.parse_args()
    common = a.common[1:] if a.common[:1] == ["--"] else a.common
    seeds = [int(s) for s in a.seeds.split(",")]
    jobs = [run_args(m, s, a.db, Path(a.out_root), common) for s in seeds for m in a.methods.split(",")]

    def go(cmd: list[str]) -> int:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"FAILED: {' '.join(cmd)}\n{r.stderr[-2000:]}", file=sys.stderr)
        return r.returncode

    with ThreadPoolExecutor(a.jobs) as ex:
        codes = list(ex.map(go, jobs))
    from fedskew.results.report import markdown_report
    from fedskew.results.store import ResultsDB

    with ResultsDB(a.db) as db:
        for metric in a.metric or ["global_acc"]:
            print(f"\n### {metric}\n")
            print(markdown_report(db.runs(), metric))
    return max(codes)


if __name__ == "__main__":
    raise SystemExit(main())
