"""Peak memory of per-client state: the same run with ``--state-store memory`` and ``--state-store disk``.

Each backend runs in a fresh subprocess (so each peak is its own): MNIST (``--data-dir``, IID over ``--clients``
clients), the method (default Ditto, which keeps a model per client), every client sampled (``--join-ratio 1``: the
issue's worst case), ``--rounds`` rounds, evaluation (every client's personal and trained model) in the last. It
prints the peak resident size (``ru_maxrss``), the resident size after the federation was built (the baseline), the
mean round time, the clients' latest state on disk (``state``) and the space the store's sparse files take
(``files``: both slots of every row written), and checks that the two backends' records are identical.

    python benchmarks/state_memory.py --data-dir ../shared/data/mnist --clients 2000
    python benchmarks/state_memory.py --data-dir ../shared/data/mnist --clients 500 --method scaffold --rounds 3

A configuration may also name where the round's uploads are stacked, ``STORE/AGGREGATION`` (``stacked``: in RAM,
``disk``: in files, ``streaming``, ``auto``), to compare the server sides of one method (issue 46):

    python benchmarks/state_memory.py --data-dir ../shared/data/mnist --clients 2000 --model cnn --rounds 1 \\
        --method fedsa --backends disk/stacked,disk/disk
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def child(args: argparse.Namespace, configuration: str) -> dict:
    import resource
    import time

    import torch

    from fedskew.config import make_config
    from fedskew.data.federated import build_federated
    from fedskew.engine.loop import Simulation
    from fedskew.protocol import TIMING_KEYS

    torch.set_num_threads(1)
    backend, _, aggregation = configuration.partition("/")
    cfg = make_config(
        None,
        {
            "dataset": "mnist",
            "data_dir": args.data_dir,
            "partition": "iid",
            "clients": args.clients,
            "join_ratio": args.join_ratio,
            "rounds": args.rounds,
            "eval_every": args.rounds,
            "method": args.method,
            "model": args.model,
            "db": None,
            "skew_probes": 0,
            "state_store": backend,
            "aggregation": aggregation or "auto",
        },
    )
    data = build_federated(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(cfg, data, state_dir=Path(tmp) / "client_state")
        base = _rss_kib()
        records, times = [], []
        for rnd in range(1, args.rounds + 1):
            t0 = time.perf_counter()
            rec = sim.round(rnd).record
            times.append(time.perf_counter() - t0)
            records.append({k: v for k, v in rec.items() if k not in TIMING_KEYS})
        on_disk, used = sim.state_store.state_bytes(), sim.state_store.disk_usage()
        sim.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    model_bytes = sum(t.numel() * t.element_size() for t in sim.global_params.values())
    return {
        "backend": sim.state_store.backend + ("/" + aggregation if aggregation else ""),
        "peak_mb": peak / 1024,
        "base_mb": base / 1024,
        "round_s": sum(times) / len(times),
        "disk_mb": on_disk / 1e6,
        "used_mb": used / 1e6,
        "model_mb": model_bytes / 1e6,
        "records": records,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True, help="directory with the MNIST IDX files")
    p.add_argument("--clients", type=int, default=2000)
    p.add_argument("--method", default="ditto")
    p.add_argument("--model", default="mlp")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--join-ratio", type=float, default=1.0)
    p.add_argument("--backends", default="memory,disk", help="configurations, each STORE[/AGGREGATION]")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args, args.child)))
        return
    results = []
    for backend in args.backends.split(","):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--child", backend]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(
        f"{args.method}, {args.clients} clients, join ratio {args.join_ratio}, {args.rounds} rounds, {args.model} "
        f"({results[0]['model_mb']:.2f} MB)"
    )
    head = ("peak RSS", "baseline", "peak-base")
    print(f"{'backend':12} " + " ".join(f"{h:>10}" for h in head) + f" {'round':>8} {'state':>10} {'files':>10}")
    for r in results:
        print(
            f"{r['backend']:12} {r['peak_mb']:8.0f}MB {r['base_mb']:8.0f}MB {r['peak_mb'] - r['base_mb']:8.0f}MB "
            f"{r['round_s']:7.2f}s {r['disk_mb']:8.0f}MB {r['used_mb']:8.0f}MB"
        )
    if len(results) > 1:
        same = all(r["records"] == results[0]["records"] for r in results[1:])
        print("records identical across backends:", same)


if __name__ == "__main__":
    main()
