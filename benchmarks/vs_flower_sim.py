"""fedskew beside Flower's Simulation Engine: the same FedAvg workload on the same device, in one run.

The peer is what a Flower user writes for FedAvg (Flower's quickstart-pytorch shape, Flower 1.4x Message API): a
``ClientApp`` whose ``train`` loads the received ``ArrayRecord`` into a plain PyTorch model, runs one local epoch of
SGD over its partition and replies with its weights and ``num-examples``; a ``ServerApp`` running Flower's own
``FedAvg`` strategy with a centralized ``evaluate_fn`` on the global test set; ``flwr.simulation.run_simulation`` on
the Ray backend (one simulated SuperNode per client; ``--num-cpus``/``--num-gpus`` per ClientApp). Both sides use
fedskew's partition of the data (each SuperNode's ``partition-id`` is a fedskew client id), the same model class
(PFLlib's CNN, ``--model``), batch size, learning rate, local epochs, participation and rounds; each side samples its
own clients (Flower's FedAvg with its RNG, fedskew with its seed), so accuracies agree statistically, not exactly.

fedskew runs the workload three times, sequential (one client after the other), with ``--batched-clients`` (a round's
clients as one stacked computation) and with ``--capture-steps`` besides (the stacked steps at padded shapes, replayed
as CUDA graphs on a GPU). Printed: each side's steady round time (median over rounds 2..R, evaluation
included: Flower's first round carries Ray's start and its actors' imports, so it is reported apart), the ratios
against Flower measured in this run, the global test accuracy after the same rounds, and the arithmetic of a round
(the model's multiply-adds counted by hooks; a training pass taken as 3 forwards at 2 FLOP per multiply-add) against
the rate a dense matmul reaches on the device in this run, so "close to the device" is a fraction.

    python benchmarks/vs_flower_sim.py --data-dir ../shared/data/mnist --device cuda     # issue 47's workload
    python benchmarks/vs_flower_sim.py --smoke                                             # CPU, digits, seconds
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.models import build_model
from fedskew.runner import run_experiment

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import macs_per_sample, matmul_gflops  # noqa: E402  (a model's multiply-adds; a device's matmul rate)


def steady(times: list[float]) -> float:
    """The median round time after the first round (the first carries warm-up), or the one round there is."""
    return statistics.median(times[1:] if len(times) > 1 else times)


# ---- the peer: a plain Flower FedAvg app ---------------------------------------------------------------------------
def flower_fedavg(args: argparse.Namespace, values: dict, folder: Path) -> dict:
    """Run the workload on Flower's Simulation Engine; its round times (between the server's evaluations, which
    follow each round's aggregation) and accuracies."""
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    data = build_federated(make_config(None, values))
    shards = folder / "shards.pt"  # every client's training split, read once per Ray actor
    torch.save([(c.x_train, c.y_train) for c in data.clients], shards)
    shape = {"in_channels": data.in_channels, "image_size": data.image_size, "num_classes": data.num_classes}
    model_name, device, lr, bs, epochs, seed = args.model, args.device, args.lr, args.batch_size, 1, args.seed
    x_test, y_test = data.x_test, data.y_test
    cache: dict[str, list] = {}

    def new_model() -> nn.Module:
        return build_model(model_name, **shape).to(device)

    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        if "shards" not in cache:
            cache["shards"] = torch.load(shards)
        cid = int(context.node_config["partition-id"])
        x, y = cache["shards"][cid]
        model = new_model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        rnd = int(msg.content["config"]["server-round"])
        g = torch.Generator().manual_seed(seed * 1_000_003 + rnd * 10_007 + cid)
        model.train()
        for _ in range(epochs):
            order = torch.randperm(len(y), generator=g)
            for i in range(0, len(y), bs):
                idx = order[i : i + bs]
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x[idx].to(device)), y[idx].to(device))
                loss.backward()
                opt.step()
        content = RecordDict(
            {
                "arrays": ArrayRecord(OrderedDict((k, v.detach().cpu()) for k, v in model.state_dict().items())),
                "metrics": MetricRecord({"num-examples": len(y)}),
            }
        )
        return Message(content=content, reply_to=msg)

    stamps: list[float] = []
    accs: list[float] = []

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model = new_model()
        model.load_state_dict(arrays.to_torch_state_dict())
        model.eval()
        with torch.no_grad():
            correct = sum(
                int((model(x_test[i : i + 1000].to(device)).argmax(1) == y_test[i : i + 1000].to(device)).sum())
                for i in range(0, len(y_test), 1000)
            )
        acc = correct / len(y_test)
        stamps.append(time.perf_counter())
        accs.append(acc)
        return MetricRecord({"accuracy": acc})

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(seed)
        initial = ArrayRecord(new_model().state_dict())
        strategy = FedAvg(
            fraction_train=args.per_round / args.clients,
            fraction_evaluate=0.0,
            min_train_nodes=args.per_round,
            min_available_nodes=args.clients,
        )
        strategy.start(grid=grid, initial_arrays=initial, num_rounds=args.rounds, evaluate_fn=central)

    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower's per-round INFO lines
    resources = {"num_cpus": args.num_cpus, "num_gpus": args.num_gpus if device.startswith("cuda") else 0.0}
    t0 = time.perf_counter()
    run_simulation(server, client, num_supernodes=args.clients, backend_config={"client_resources": resources})
    total = time.perf_counter() - t0
    # evaluate_fn runs before round 1 (the initial model) and after each round: round r took stamps[r] - stamps[r-1]
    rounds = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    if len(rounds) != args.rounds:
        raise RuntimeError(f"Flower's simulation evaluated {len(stamps)} times for {args.rounds} rounds")
    return {"round_times": rounds, "acc": accs[1:], "total": total}


# ---- fedskew -------------------------------------------------------------------------------------------------------
FEDSKEW_SIDES = {  # fedskew's ways of training a round's clients: the settings each side sets
    "sequential": {},
    "batched": {"batched_clients": True},
    "captured": {"batched_clients": True, "capture_steps": True},  # padded steps replayed as CUDA graphs
}


def fedskew_fedavg(values: dict, folder: Path, side: str) -> dict:
    cfg = make_config(None, {**values, **FEDSKEW_SIDES[side], "out": str(folder / side)})
    t0 = time.perf_counter()
    out = run_experiment(cfg)
    total = time.perf_counter() - t0
    return {
        "round_times": [r["time_round"] for r in out.records],
        "acc": [r["global_acc"] for r in out.records],
        "total": total,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default="", help="the mnist/ folder (default: the embedded digits)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--per-round", type=int, default=50, help="clients sampled each round")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--model", default="cnn")
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-cpus", type=float, default=1.0, help="Flower: CPUs per ClientApp")
    p.add_argument("--num-gpus", type=float, default=0.1, help="Flower: GPUs per ClientApp (CUDA only)")
    p.add_argument(
        "--skip", default="", help="comma-separated sides to leave out: flower, sequential, batched, captured"
    )
    p.add_argument("--json", default="", help="also write the figures to this file")
    p.add_argument("--smoke", action="store_true", help="digits, 20 clients, 5 a round, 3 rounds (CI, CPU)")
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.per_round, args.rounds, args.data_dir = 20, 5, 3, ""
    if not 0 < args.per_round <= args.clients:
        p.error(f"--per-round must lie in 1..--clients ({args.clients}); got {args.per_round}")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    values = {
        "dataset": "mnist" if args.data_dir else "digits",
        "partition": "iid",
        "clients": args.clients,
        "join_ratio": args.per_round / args.clients,
        "rounds": args.rounds,
        "local_epochs": 1,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "model": args.model,
        "device": args.device,
        "seed": args.seed,
        "skew_probes": 0,
        "db": None,
        **({"data_dir": args.data_dir} if args.data_dir else {}),
    }
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - {"flower", *FEDSKEW_SIDES}
    if unknown:
        p.error(f"--skip: unknown sides {sorted(unknown)}")
    data = build_federated(make_config(None, values))
    model = build_model(
        args.model, in_channels=data.in_channels, image_size=data.image_size, num_classes=data.num_classes
    )
    macs = macs_per_sample(model, data.x_test[:1])
    train_flop = args.per_round * statistics.mean(len(c.y_train) for c in data.clients) * 6 * macs  # 3 passes x 2
    # Flower's app scores the global test set; fedskew's round also scores every client's own test split (its
    # per-client views): more work in fedskew's round, counted in its FLOP
    eval_flop = {"flower": len(data.y_test) * 2 * macs}
    eval_flop.update({side: (len(data.y_test) + len(data.local_y)) * 2 * macs for side in FEDSKEW_SIDES})
    peak = matmul_gflops(args.device)
    print(
        f"workload: {values['dataset']}, {args.clients} clients (IID), {args.per_round} a round, {args.rounds} rounds, "
        f"batch {args.batch_size}, 1 epoch, {args.model} ({macs:,} multiply-adds a sample); device {args.device}; "
        f"torch {torch.__version__}"
    )
    print(
        f"arithmetic per round: training {train_flop / 1e9:.3f} GFLOP; evaluation {eval_flop['flower'] / 1e9:.3f} "
        f"GFLOP (Flower's app: the global test set), {eval_flop['batched'] / 1e9:.3f} GFLOP (fedskew: also every "
        f"client's own test split); dense fp32 matmul on the device in this run: {peak:.0f} GFLOP/s"
    )
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="fedskew-vs-flower-") as tmp:
        folder = Path(tmp)
        for side in ("flower", *FEDSKEW_SIDES):
            if side in skip:
                continue
            if side == "flower":
                results[side] = flower_fedavg(args, values, folder)
            else:
                results[side] = fedskew_fedavg(values, folder, side)
    figures: dict[str, dict] = {}
    for side, r in results.items():
        t = steady(r["round_times"])
        flop = train_flop + eval_flop[side]
        figures[side] = {
            "first_round_s": r["round_times"][0],
            "steady_round_s": t,
            "total_s": r["total"],
            "final_acc": r["acc"][-1],
            "fraction_of_matmul_rate": flop / t / 1e9 / peak,
        }
        print(
            f"{side:>10}: steady round {t * 1000:.1f} ms (first {r['round_times'][0]:.2f} s), {r['total']:.1f} s in "
            f"all; accuracy after {args.rounds} rounds {r['acc'][-1] * 100:.2f}; "
            f"{flop / t / 1e9:.2f} GFLOP/s = {figures[side]['fraction_of_matmul_rate'] * 100:.2f}% of the matmul rate"
        )
    if "flower" in figures:
        for side in FEDSKEW_SIDES:
            if side in figures:
                ratio = figures["flower"]["steady_round_s"] / figures[side]["steady_round_s"]
                figures[side]["vs_flower"] = ratio
                print(f"fedskew {side} vs Flower: {ratio:.2f}x (steady round time, Flower's / fedskew's)")
    if args.json:
        record = {"device": args.device, "train_gflop_round": train_flop / 1e9, "matmul_gflops": peak}
        Path(args.json).write_text(json.dumps({**record, "sides": figures}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
