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


def test_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: str) -> float:
    """The global test accuracy every side reports after a round (batches of 1,000, no gradients)."""
    model.eval()
    with torch.no_grad():
        correct = sum(
            int((model(x[i : i + 1000].to(device)).argmax(1) == y[i : i + 1000].to(device)).sum())
            for i in range(0, len(y), 1000)
        )
    return correct / len(y)


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
        acc = test_accuracy(model, x_test, y_test, device)
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


# ---- the second peer: pfl-research (Apple's ``pfl``) --------------------------------------------------------------
def pfl_fedavg(args: argparse.Namespace, values: dict, folder: Path) -> dict:
    """Run the workload on pfl-research's simulator (``pfl``, the library behind its published benchmarks), written
    as its PyTorch quick start does: every client a ``pfl.data.dataset.Dataset`` of its training split in a
    ``FederatedDataset``, ``PyTorchModel`` with a plain SGD local optimizer and a central SGD(lr=1) (FedAvg's model
    update), ``FederatedAveraging`` on a ``SimulatedBackend``. Users come from pfl's ``minimize_reuse`` sampler over a
    seeded order of the clients (each round's cohort without repeats, every client once per pass; pfl's ``random``
    sampler draws with replacement from numpy's unseeded global state, so a cohort can hold a client twice and two
    runs differ). A callback scores the global
    test set after each round (inside the round's time, as Flower's evaluate_fn) and stamps the time. pfl iterates a
    client's data in its stored order, so each client's split is stored in one seeded random order (with one local
    epoch a round, what a reshuffle would give)."""
    os.environ["PFL_PYTORCH_DEVICE"] = args.device  # read by pfl when it picks its device
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    data = build_federated(make_config(None, values))
    device = args.device
    torch.manual_seed(args.seed)
    net = build_model(
        args.model, in_channels=data.in_channels, image_size=data.image_size, num_classes=data.num_classes
    )

    class Peer(nn.Module):  # pfl's PyTorch contract: loss(*batch) and metrics(*batch)
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:  # noqa: A002
            self.eval() if eval else self.train()
            return nn.functional.cross_entropy(self(x), y)

        @torch.no_grad()
        def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict:  # noqa: A002
            self.eval()
            out = self(x)
            loss = float(nn.functional.cross_entropy(out, y, reduction="sum"))
            return {"loss": Weighted(loss, len(y)), "accuracy": Weighted(float((out.argmax(1) == y).sum()), len(y))}

    peer = Peer()
    g = torch.Generator().manual_seed(args.seed)
    orders = [torch.randperm(len(c.y_train), generator=g) for c in data.clients]  # pfl does not reshuffle
    shards = {
        i: (c.x_train[o].to(device), c.y_train[o].to(device))
        for i, (c, o) in enumerate(zip(data.clients, orders, strict=True))
    }
    training = FederatedDataset(
        make_dataset_fn=lambda uid: Dataset(raw_data=list(shards[uid]), user_id=uid),
        user_sampler=get_user_sampler("minimize_reuse", torch.randperm(len(shards), generator=g).tolist()),
    )
    model = PyTorchModel(
        model=peer,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(peer.parameters(), lr=1.0),
    )
    x_test, y_test = data.x_test.to(device), data.y_test.to(device)
    stamps: list[float] = []
    accs: list[float] = []

    class Stamp(TrainingProcessCallback):
        def on_train_begin(self, *, model: PyTorchModel) -> Metrics:
            stamps.append(time.perf_counter())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):  # type: ignore[no-untyped-def]
            accs.append(test_accuracy(peer, x_test, y_test, device))
            stamps.append(time.perf_counter())
            return False, Metrics()

    t0 = time.perf_counter()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=args.rounds,
            evaluation_frequency=args.rounds + 1,
            train_cohort_size=args.per_round,
            val_cohort_size=0,
        ),
        backend=SimulatedBackend(training_data=training, val_data=None),
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=1, local_learning_rate=args.lr, local_batch_size=args.batch_size
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=1000),
        callbacks=[Stamp()],
        send_metrics_to_platform=False,
    )
    total = time.perf_counter() - t0
    rounds = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    if len(rounds) != args.rounds:
        raise RuntimeError(f"pfl ran {len(rounds)} rounds for {args.rounds}")
    return {"round_times": rounds, "acc": accs, "total": total}


# ---- fedskew -------------------------------------------------------------------------------------------------------
FEDSKEW_SIDES = {  # fedskew's ways of training a round's clients: the settings each side sets
    "sequential": {},
    "batched": {"batched_clients": True},
    "captured": {"batched_clients": True, "capture_steps": True},  # padded steps replayed as CUDA graphs
}


PEERS = {"flower": flower_fedavg, "pfl": pfl_fedavg}  # the other simulators, each as its users write FedAvg
PEER_PACKAGES = {"flower": ("flwr", "the [flower-sim] extra"), "pfl": ("pfl", "the [pfl] extra: pip install pfl")}


def not_installed(peer: str) -> str:
    """Why a peer's side cannot run here ("" when its package imports)."""
    import importlib.util

    module, extra = PEER_PACKAGES[peer]
    return "" if importlib.util.find_spec(module) else f"{module} is not installed ({extra})"


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
        "--skip", default="", help="comma-separated sides to leave out: flower, pfl, sequential, batched, captured"
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
    unknown = skip - {*PEERS, *FEDSKEW_SIDES}
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
    eval_flop = {peer: len(data.y_test) * 2 * macs for peer in PEERS}
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
    missing = {peer: why for peer, why in ((p, not_installed(p)) for p in PEERS if p not in skip) if why}
    for peer, why in missing.items():
        print(f"{peer:>10}: side not run: {why}")
    with tempfile.TemporaryDirectory(prefix="fedskew-vs-flower-") as tmp:
        folder = Path(tmp)
        for side in (*PEERS, *FEDSKEW_SIDES):
            if side in skip or side in missing:
                continue
            if side in PEERS:
                results[side] = PEERS[side](args, values, folder)
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
    for peer, name in (("flower", "Flower"), ("pfl", "pfl")):
        for side in FEDSKEW_SIDES:
            if peer in figures and side in figures:
                ratio = figures[peer]["steady_round_s"] / figures[side]["steady_round_s"]
                figures[side][f"vs_{peer}"] = ratio
                print(f"fedskew {side} vs {name}: {ratio:.2f}x (steady round time, {name}'s / fedskew's)")
    if args.json:
        record = {"device": args.device, "train_gflop_round": train_flop / 1e9, "matmul_gflops": peak}
        record["not_run"] = missing
        Path(args.json).write_text(json.dumps({**record, "sides": figures}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
