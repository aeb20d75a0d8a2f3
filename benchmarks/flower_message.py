"""What one Flower client message costs a fresh ``flwr-clientapp`` process, phase by phase, before and after issue 24.

Flower serves every message (hello, train, evaluate) in a fresh ClientApp process, so whatever a client builds is
paid per message. Each measurement below runs in a fresh Python process (as Flower's would), ``--repeats`` times,
and reports the median seconds and the peak resident memory the phase added:

* ``python``: the interpreter starting (``python -c pass``);
* ``imports``: importing fedskew's ClientApp (torch, flwr, fedskew);
* ``data: whole federation`` -- what every message did before issue 24: build the whole federation
  (:func:`fedskew.data.federated.build_federated`) and pick the client's part;
* ``data: own part, first message`` -- ``flower.data = partition``: build it once and cache the client's part;
* ``data: own part, cached`` -- every later message: load the cached part (target < 0.3 s and < 300 MB);
* ``data: node's own files`` -- ``flower.data = node``: read the node's own ``.npz``;
* ``model + method``: resolve the method and build the model (every message).

Then, optionally (``--round``), one round on the simulator against the same round over the in-process Flower grid
(the real apps, no network) and against a loopback deployment of 3 SuperNodes, alternating, to show what the
framework adds per round.

    python benchmarks/flower_message.py --dataset fmnist --data-dir ../shared/data --clients 20
    python benchmarks/flower_message.py            # the embedded digits (offline)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PHASE = r"""
import json, resource, sys, time
def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
phase, cfg_json, cid, node_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if phase == "python":
    print(json.dumps({"mb": peak_mb()}))
    sys.exit()
out = {}
t = time.perf_counter()
import fedskew.flower.client_app  # noqa: F401  (torch, flwr, fedskew: what every message imports)
from fedskew.config import make_config
from fedskew.engine.model_init import init_model
from fedskew.flower import node_data
from fedskew.methods import resolve_method
cfg = make_config(json.loads(cfg_json))
out["imports"] = {"seconds": time.perf_counter() - t, "mb": peak_mb()}
base = peak_mb()
t = time.perf_counter()
if phase == "whole":
    from fedskew.data.federated import build_federated
    data = build_federated(cfg)
    part = node_data.NodePart(data.name, data.num_classes, data.in_channels, data.image_size, data.clients[cid])
elif phase == "node":
    part = node_data.own_part(cfg.model_copy(update={"data_dir": node_dir, "dataset": "npz"}), cid)
else:
    part = node_data.cached_part(cfg, cid)
out["data"] = {"seconds": time.perf_counter() - t, "mb": peak_mb() - base, "samples": int(len(part.client.y_train))}
t = time.perf_counter()
init_model(cfg, part.federation(), resolve_method(cfg.method, cfg.method_args))
out["model"] = {"seconds": time.perf_counter() - t}
print(json.dumps(out))
"""


def fresh(phase: str, cfg: dict, cid: int, node_dir: str, env: dict[str, str]) -> tuple[float, dict]:
    """One fresh process running ``phase``; (its wall seconds, what it measured)."""
    import time

    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", PHASE, phase, json.dumps(cfg), str(cid), node_dir],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"phase {phase} failed:\n{done.stderr[-3000:]}")
    return wall, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--partition", default="dir")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--cid", type=int, default=0, help="the client whose message is timed")
    ap.add_argument("--method", default="fedavg+disco")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--round", action="store_true", help="also time a round: simulator, in-process Flower, loopback")
    ap.add_argument("--round-clients", type=int, default=3, help="clients (SuperNodes) of the round timing (3)")
    args = ap.parse_args()
    cfg = {
        "dataset": args.dataset,
        "data_dir": args.data_dir,
        "clients": args.clients,
        "partition": args.partition,
        "alpha": args.alpha,
        "method": args.method,
        "threads": 1,
    }
    with tempfile.TemporaryDirectory(prefix="fedskew-flower-message-") as tmp:
        env = {**os.environ, "FEDSKEW_CACHE": str(Path(tmp) / "cache"), "OMP_NUM_THREADS": "1"}
        node_dir = Path(tmp) / "node"
        node_dir.mkdir()
        _write_node_files(cfg, args.cid, node_dir, env)
        rows: dict[str, list[tuple[float, float, float]]] = {}
        for r in range(args.repeats):
            for phase in ("python", "whole", "first", "cached", "node"):
                if phase == "first":
                    for f in (Path(tmp) / "cache").rglob("*.pt"):
                        f.unlink()  # a cache this benchmark created: the first message builds it again
                wall, got = fresh(phase, cfg, args.cid, str(node_dir), env)
                if phase == "python":
                    rows.setdefault("python (start + exit)", []).append((wall, got["mb"], 0))
                    continue
                rows.setdefault("imports", []).append((got["imports"]["seconds"], got["imports"]["mb"], 0))
                label = {
                    "whole": "data: whole federation (before)",
                    "first": "data: own part, first message (builds the cache)",
                    "cached": "data: own part, cached",
                    "node": "data: node's own files (flower.data = node)",
                }[phase]
                d = got["data"]
                rows.setdefault(label, []).append((d["seconds"], d["mb"], d["samples"]))
                rows.setdefault("model + method", []).append((got["model"]["seconds"], 0.0, 0))
                rows.setdefault(f"whole process ({phase})", []).append((wall, 0.0, 0))
            print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    print(f"\nfresh-process cost of one client message: {args.dataset}, {args.clients} clients, client {args.cid}")
    print(f"{'phase':58s} {'median s':>9s} {'peak MB':>8s} {'samples':>8s}")
    for label, vals in rows.items():
        secs = statistics.median(v[0] for v in vals)
        mb = statistics.median(v[1] for v in vals)
        n = max(v[2] for v in vals)
        print(f"{label:58s} {secs:9.3f} {mb:8.0f} {n or '':>8}")
    whole = statistics.median(v[0] for v in rows["data: whole federation (before)"])
    cached = statistics.median(v[0] for v in rows["data: own part, cached"])
    print(f"\ndata per message, before / after (cached part): {whole:.3f} s / {cached:.3f} s = {whole / cached:.1f}x")
    if args.round:
        _round_times(cfg, args)


def _write_node_files(cfg: dict, cid: int, node_dir: Path, env: dict[str, str]) -> None:
    """Client ``cid``'s part of the partition as a node's own .npz (what ``flower.data = node`` reads)."""
    script = (
        "import json, sys, numpy as np\n"
        "from fedskew.config import make_config\n"
        "from fedskew.data.federated import build_federated\n"
        "cfg = make_config(json.loads(sys.argv[1])); data = build_federated(cfg); c = data.clients[int(sys.argv[2])]\n"
        "u8 = lambda t: np.round((t.numpy() * 0.5 + 0.5) * 255).astype(np.uint8)\n"
        "np.savez(sys.argv[3], x=u8(c.x_train), y=c.y_train.numpy(), x_test=u8(c.x_test), y_test=c.y_test.numpy(),"
        " num_classes=data.num_classes)\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, json.dumps(cfg), str(cid), str(node_dir / "data.npz")], env=env, check=True
    )


def _round_times(cfg: dict, args: argparse.Namespace) -> None:
    """A round's time (median over the rounds of ``--repeats`` runs of 3 rounds, every round evaluated): the
    simulator, the Flower apps over the in-process grid, and a loopback deployment (a SuperLink and one SuperNode per
    client as processes on 127.0.0.1, each message a fresh ClientApp process)."""
    from fedskew.config import make_config
    from fedskew.flower.inprocess import run_in_process
    from fedskew.flower.loopback import Loopback
    from fedskew.flower.settings import FlowerSettings, write_app
    from fedskew.runner import run_experiment

    fast = FlowerSettings(poll_interval=0.05)
    times: dict[str, list[float]] = {"simulator": [], "flower, in process": [], "flower, loopback": []}

    def rounds(run_dir: Path) -> list[float]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["time_round"] for line in lines]

    with tempfile.TemporaryDirectory(prefix="fedskew-flower-round-") as tmp:
        os.environ["FEDSKEW_CACHE"] = str(Path(tmp) / "cache")
        base = make_config({**cfg, "clients": args.round_clients, "rounds": 3, "skew_probes": 0, "db": None})
        write_app(Path(tmp) / "app", base, fast)
        for r in range(args.repeats):
            run_experiment(base.model_copy(update={"out": str(Path(tmp) / f"sim{r}")}))
            times["simulator"] += rounds(Path(tmp) / f"sim{r}")
            run_in_process(base.model_copy(update={"out": str(Path(tmp) / f"fl{r}")}), fast)
            times["flower, in process"] += rounds(Path(tmp) / f"fl{r}")
            with Loopback(Path(tmp) / f"home{r}", args.round_clients) as fed:
                fed.run_app(Path(tmp) / "app", {"out": str(Path(tmp) / f"lb{r}"), "db": ""}, timeout=1800)
            times["flower, loopback"] += rounds(Path(tmp) / f"lb{r}")
    print(f"\nround time, {args.round_clients} clients ({cfg['dataset']}), median over {args.repeats} x 3 rounds:")
    sim = statistics.median(times["simulator"])
    for label, vals in times.items():
        med = statistics.median(vals)
        spread = f"rounds {min(vals):.2f}-{max(vals):.2f} s"
        print(f"  {label:20s} {med:8.3f} s  ({med / sim:7.1f}x the simulator; {spread})")


if __name__ == "__main__":
    main()
