"""Time per phase of a fedskew round, against a minimal plain-PyTorch loop over the same data, measured in one run.

Default setting: MNIST, Dirichlet(0.1) over 20 clients, the PFLlib CNN, 1 local epoch, batch 10, lr 0.005.
For every round the script runs fedskew's round (local training, aggregation, evaluation) and then a minimal
plain-PyTorch FedAvg round (same model architecture, same client tensors, same batch size and number of steps,
`load_state_dict` per client, SGD, a sample-weighted mean of `state_dict`s), alternating so that machine drift hits
both equally. It prints the ratio of fedskew's local-training time to the plain loop's (target <= 1.05).

    python benchmarks/round_time.py --data-dir ../shared/data/mnist --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.engine.loop import Simulation, init_model


def plain_round(
    model: torch.nn.Module, global_sd: dict, data, batch_size: int, lr: float, seed: int
) -> tuple[float, dict]:
    """The reference: the simplest correct FedAvg round in plain PyTorch."""
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    states, sizes = [], []
    for c in data.clients:
        model.load_state_dict(global_sd)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        x, y = c.x_train, c.y_train
        perm = torch.randperm(x.shape[0], generator=g).to(x.device)
        for i in range(0, x.shape[0], batch_size):
            idx = perm[i : i + batch_size]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        sizes.append(x.shape[0])
    t_train = time.perf_counter() - t0
    total = sum(sizes)
    new = {
        k: sum(s[k].double() * (n / total) for s, n in zip(states, sizes, strict=True)).to(v.dtype)
        for k, v in global_sd.items()
    }
    if x.is_cuda:
        torch.cuda.synchronize()
    return t_train, new


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--data-dir", default=None, help="default: $FEDSKEW_DATA or ../shared/data/mnist if present")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--model", default="cnn")
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads for both loops (fedskew's default is 1; 0: torch's)"
    )
    p.add_argument(
        "--channels-last", action="store_true", help="convolutions in channels-last order, in both loops (same model)"
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data_dir = args.data_dir
    fallback = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"
    if data_dir is None and args.dataset == "mnist" and fallback.is_dir():
        data_dir = str(fallback)
    cfg = make_config(
        None,
        {
            "dataset": args.dataset,
            "data_dir": data_dir,
            "partition": "dir",
            "alpha": 0.1,
            "clients": args.clients,
            "rounds": args.rounds,
            "model": args.model,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "device": args.device,
            "threads": args.threads,
            "channels_last": args.channels_last,
            "db": None,
        },
    )
    data = build_federated(cfg)
    sim = Simulation(cfg, data)
    ref = init_model(cfg, data)  # same architecture and initial weights, a separate instance
    ref_sd = {k: v.clone() for k, v in sim.global_params.items()}
    n_train = sum(len(c.y_train) for c in data.clients)
    print(
        f"{args.dataset}: {args.clients} clients, {n_train} training samples, model {sim.model_name}, "
        f"batch {args.batch_size}, device {args.device}, torch threads {torch.get_num_threads()}, "
        f"channels-last {args.channels_last}"
    )
    rows = []
    for rnd in range(1, args.rounds + 1):
        # alternate which loop goes first, so that drift and cache effects hit both equally
        if rnd % 2 == 0:
            t_plain, ref_sd = plain_round(ref, ref_sd, data, args.batch_size, args.lr, seed=rnd)
            rec = sim.round(rnd).record
        else:
            rec = sim.round(rnd).record
            t_plain, ref_sd = plain_round(ref, ref_sd, data, args.batch_size, args.lr, seed=rnd)
        rows.append((rec["time_train"], t_plain, rec["time_aggregate"], rec["time_eval"], rec.get("global_acc")))
        print(
            f"round {rnd}: fedskew train {rec['time_train']:.2f}s | plain train {t_plain:.2f}s | "
            f"aggregate {rec['time_aggregate']:.3f}s | eval {rec['time_eval']:.3f}s | "
            f"global acc {100 * rec['global_acc']:.2f}%",
            flush=True,
        )
    med = [statistics.median(col) for col in list(zip(*rows, strict=True))[:4]]
    print()
    print("| phase (median over rounds) | seconds |")
    print("|---|---|")
    print(f"| fedskew local training | {med[0]:.3f} |")
    print(f"| plain PyTorch local training | {med[1]:.3f} |")
    print(f"| fedskew aggregation | {med[2]:.4f} |")
    print(f"| fedskew evaluation (global test + all clients' tests) | {med[3]:.3f} |")
    print(f"\nratio fedskew/plain local training: {med[0] / med[1]:.3f} (target <= 1.05, issue 15)")
    print(f"evaluation per round: {med[3]:.3f}s = {100 * med[3] / med[0]:.1f}% of local training")


if __name__ == "__main__":
    main()
