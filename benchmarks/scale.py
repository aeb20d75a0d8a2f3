"""Cross-device scale: FedAvg and Ditto with 1,000 to 100,000 clients of ~10 samples, a few dozen per round.

Each (method, clients) pair runs in a fresh subprocess (so each peak resident size is its own) on synthetic
8x8 one-channel images (``--side 28 --model cnn``: MNIST-sized, PFLlib's CNN) of random pixels and labels among 10
(the speed and memory of a federation do not depend on what it learns), IID over the clients, ``--samples``
training samples per client, ``--per-round`` clients sampled per round, the 2-hidden-layer MLP (``--model``), batch
10, 1 local epoch, the client-state store the run picks (``state_store auto``: on disk when the clients' state would
exceed ``state_memory``; ``--state-store`` to force one). Per round it times
fedskew's training of the sampled clients and then **the same SGD steps in a plain PyTorch loop** (the reference:
``load_state_dict`` per client, ``torch.optim.SGD``, the client's own batches; Ditto: the client's personal model,
kept in a dict across rounds as Ditto must, trained with its proximal term and kept, then the global pass),
alternating so that machine drift hits both. It prints

- round time (training, aggregation; no evaluation in the timed rounds) and the plain loop's time,
- **fixed cost per client** = (fedskew's training time − the plain loop's) / clients per round,
- peak resident size, the resident size after the federation was built, and the clients' state on disk,
- one sampled evaluation (``eval_clients``) of the per-client views, timed.

    python benchmarks/scale.py                                       # 1,000 and 10,000 clients, FedAvg and Ditto
    python benchmarks/scale.py --clients 1000,10000,100000 --rounds 20
    python benchmarks/scale.py --clients 300 --rounds 2 --per-round 20 # the CI-sized check
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def plain_round(
    model,
    global_sd: dict,
    clients: list,
    batch_size: int,
    lr: float,
    prox: float | None,
    seed: int,
    personal: dict | None = None,
) -> float:
    """The reference: the same clients' SGD steps in the simplest correct plain-PyTorch loop; ``prox`` (Ditto's
    lambda): first the client's personal model (kept in ``personal`` across rounds, by client; the received model
    at its first participation) trained with Ditto's proximal term to the received model and kept, then the global
    pass."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    anchor = [t.detach() for t in global_sd.values()]
    kept = {} if personal is None else personal
    t0 = time.perf_counter()
    for c in clients:
        for lam in ([prox] if prox is not None else []) + [None]:
            model.load_state_dict(kept.get(c.cid, global_sd) if lam is not None else global_sd)
            params = list(model.parameters())
            opt = torch.optim.SGD(params, lr=lr)
            x, y = c.x_train, c.y_train
            perm = torch.randperm(x.shape[0], generator=g)
            for i in range(0, x.shape[0], batch_size):
                idx = perm[i : i + batch_size]
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x[idx]), y[idx])
                if lam:
                    loss = loss + 0.5 * lam * sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))
                loss.backward()
                opt.step()
            if lam is not None:  # Ditto keeps the personal model (a copy: the next client trains the same module)
                kept[c.cid] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return time.perf_counter() - t0


def sim_lam(method: str) -> float:
    """Ditto's proximal weight as fedskew resolves the method (its default)."""
    from fedskew.methods import resolve_method

    return resolve_method(method, {}).client.lam  # type: ignore[attr-defined]


def child(args: argparse.Namespace, method: str, n: int) -> dict:
    import resource

    import numpy as np
    import torch

    from fedskew.config import make_config
    from fedskew.data.federated import build_federated
    from fedskew.data.readers import ImageDataset
    from fedskew.engine.loop import Simulation
    from fedskew.engine.rounds import sample_clients

    torch.set_num_threads(1)
    start = _rss_mb()
    per_client = args.samples + max(1, round(args.samples / 3))  # ~75% of it trains (train_ratio 0.75)
    rng = np.random.default_rng(0)
    dataset = ImageDataset(
        f"synthetic-{args.side}x{args.side}",
        rng.integers(0, 256, (n * per_client, 1, args.side, args.side), dtype=np.uint8),
        rng.integers(0, 10, n * per_client).astype(np.int64),
        rng.integers(0, 256, (1000, 1, args.side, args.side), dtype=np.uint8),
        rng.integers(0, 10, 1000).astype(np.int64),
        10,
    )
    rounds = args.rounds
    cfg = make_config(
        None,
        {
            "dataset": "digits",
            "partition": "iid",
            "clients": n,
            "join_ratio": args.per_round / n,
            "rounds": rounds + 2,  # rounds+1: one sampled evaluation; the last round (every client) is never run
            "eval_every": rounds + 1,
            "eval_clients": args.eval_clients,
            "method": method,
            "model": args.model,
            "batch_size": 10,
            "lr": 0.05,
            "db": None,
            "skew_probes": 0,
            "checkpoint_every": 0,
            "state_store": args.state_store,
            "aggregation": args.child_aggregation,
            **({"state_memory": args.state_memory} if args.state_memory else {}),
        },
    )
    t0 = time.perf_counter()
    data = build_federated(cfg, dataset)
    build_s = time.perf_counter() - t0
    del dataset
    prox = float(sim_lam(method)) if method == "ditto" else None
    with tempfile.TemporaryDirectory() as tmp:
        sim = Simulation(cfg, data, state_dir=Path(tmp) / "client_state")
        base = _rss_mb()
        ours, plain, clients = [], [], []
        ref_model = copy.deepcopy(sim.model)  # the plain loop's own model of the same architecture
        ref_personal: dict = {}  # the plain loop's Ditto personal models, by client
        for rnd in range(1, rounds + 1):
            sampled = sample_clients(cfg.seed, rnd, n, cfg.join_ratio)
            chunk = [data.clients[c] for c in sampled]
            gsd = {k: v.clone() for k, v in sim.global_params.items()}

            def run_plain(chunk=chunk, gsd=gsd, rnd=rnd) -> float:
                return plain_round(ref_model, gsd, chunk, cfg.batch_size, cfg.lr, prox, rnd, ref_personal)

            if rnd % 2:
                p = run_plain()
                rec = sim.round(rnd).record
            else:
                rec = sim.round(rnd).record
                p = run_plain()
            ours.append(rec["time_train"])
            plain.append(p)
            clients.append(rec["participants"])
        t0 = time.perf_counter()
        rec = sim.round(rounds + 1).record  # trains, then evaluates (a sampled evaluation)
        eval_s = rec["time_eval"]
        sampled_eval = rec.get("eval_clients")
        state_mb = sim.state_store.state_bytes() / 1e6
        streamed = sim.server.streaming
        backend = sim.state_store.backend
        sim.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    skip = 1 if rounds > 2 else 0  # the first round warms up
    train = statistics.median(ours[skip:])
    ref = statistics.median(plain[skip:])
    k = statistics.median(clients[skip:])
    return {
        "method": method,
        "clients": n,
        "per_round": k,
        "backend": backend,
        "build_s": build_s,
        "train_s": train,
        "plain_s": ref,
        "fixed_ms": 1e3 * (train - ref) / k,
        "ratio": train / ref,
        "peak_mb": peak,
        "start_mb": start,
        "base_mb": base,
        "state_mb": state_mb,
        "eval_s": eval_s,
        "eval_clients": sampled_eval,
        "aggregation": "streaming" if streamed else "stacked",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="1000,10000", help="comma-separated federation sizes")
    p.add_argument("--methods", default="fedavg,ditto")
    p.add_argument("--per-round", type=int, default=50)
    p.add_argument("--model", default="mlp", help="mlp or cnn (PFLlib's CNN; use --side 28)")
    p.add_argument("--side", type=int, default=8, help="image side (8: digits-sized; 28: MNIST-sized)")
    p.add_argument("--samples", type=int, default=10, help="training samples per client (about)")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (the first is a warm-up when > 2)")
    p.add_argument("--eval-clients", type=int, default=100, help="clients scored by the one sampled evaluation")
    p.add_argument("--state-store", default="auto", choices=("auto", "memory", "disk"))
    p.add_argument("--state-memory", default=None, help="the store's memory budget (e.g. 2GB)")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument(
        "--aggregation",
        default="auto",
        help="comma-separated: auto, stacked, streaming (each (method, clients) runs once per mode; auto streams a "
        "weighted-mean composition whose stacked uploads would exceed 512 MiB)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-aggregation", default="auto", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        method, n = args.child.split(":")
        print(json.dumps(child(args, method, int(n))))
        return
    results = []
    head = (
        f"{'method':7} {'clients':>8} {'uploads':>9} {'store':>6} {'round train':>11} {'plain SGD':>10} {'ratio':>6} "
        f"{'fixed/client':>12} {'peak RSS':>9} {'built':>8} {'state':>9} {'eval':>14}"
    )
    print(
        f"synthetic {args.side}x{args.side} images, {args.model}, ~{args.samples} training samples per client, "
        f"{args.per_round} clients per round, "
        f"batch 10, 1 epoch, 1 thread; medians over {args.rounds} rounds"
    )
    print(head)
    for n in (int(x) for x in args.clients.split(",")):
        for method, mode in ((m, a) for m in args.methods.split(",") for a in args.aggregation.split(",")):
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", f"{method}:{n}", "--child-aggregation", mode]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            results.append(r)
            ev = f"{r['eval_s']:.2f}s/{r['eval_clients'] or 'all'}"
            print(
                f"{method:7} {n:>8} {r['aggregation']:>9} {r['backend']:>6} "
                f"{1e3 * r['train_s']:9.1f}ms {1e3 * r['plain_s']:8.1f}ms "
                f"{r['ratio']:5.2f}x {r['fixed_ms']:10.2f}ms {r['peak_mb']:7.0f}MB {r['base_mb']:6.0f}MB "
                f"{r['state_mb']:7.0f}MB {ev:>14}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
