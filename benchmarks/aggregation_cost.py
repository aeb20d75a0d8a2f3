"""Cost of FedSA/FedPake's (and FedCAC's, FedAMP's) server step against FedAvg's, and against one round of local
training.

For each model (the small CNN on MNIST-shaped input, ResNet-18 on CIFAR-10-shaped input) the script builds the
uploads of 20 clients as "global model + small client-specific noise" (the scale of one local epoch's drift,
with log-normal spread across clients and positions; BatchNorm buffers perturbed too, ``num_batches_tracked``
advanced), stacks them once with :func:`fedskew.server.uploads.stack_uploads`, and times the server step

- FedAvg: ``Aggregation(SampleWeights(), WeightedMean())``
- FedSA:  ``Aggregation(SampleWeights(), FedSACombine())`` (paper defaults lam = delta = 0.2, C = S = 4)
- FedCAC: ``FedCAC(SampleWeights())`` on the same uploads plus their critical masks (tau 0.5 of the change against the
  global model), i.e. the overlap matrix, collaborators and one customized model per client
- FedAMP: ``FedAMP(SampleWeights())``: pairwise distances and one cloud model per client

(median of ``--repeats`` runs after one warm-up). Local training is timed as SGD steps (lr 0.005, batch
10, the PFLlib defaults, spec 1.7) on random input of the dataset's shape, extrapolated to one local epoch
per client and 20 clients per round, with PFLlib's split (train+test merged, 75% train per client):
MNIST 70,000 x 0.75 / 20 = 2,625 and CIFAR-10 60,000 x 0.75 / 20 = 2,250 samples per client.

    PYTHONPATH=src python benchmarks/aggregation_cost.py            # CPU, a few minutes at most
    PYTHONPATH=src python benchmarks/aggregation_cost.py --quick    # fewer repeats and steps
    PYTHONPATH=src python benchmarks/aggregation_cost.py --device cuda
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedskew.catalog.fedamp import FedAMP
from fedskew.catalog.fedcac import CriticalMasks, FedCAC
from fedskew.catalog.fedsa import FedSACombine
from fedskew.models import build_model
from fedskew.protocol import RoundInput, Upload
from fedskew.server.api import Aggregation
from fedskew.server.combine import WeightedMean
from fedskew.server.uploads import stack_uploads
from fedskew.server.weights import SampleWeights


@dataclass(frozen=True)
class Setting:
    label: str
    model: str
    in_channels: int
    image_size: int
    num_classes: int
    samples_per_client: int


SETTINGS = (
    Setting("CNN / MNIST 1x28x28", "cnn", 1, 28, 10, 2625),
    Setting("ResNet-18 / CIFAR-10 3x32x32", "resnet18", 3, 32, 10, 2250),
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs, after ``warmup`` warm-up runs."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def client_round(model: nn.Module, clients: int, seed: int) -> RoundInput:
    """Uploads = global + client noise: std ~ 1% of each tensor's spread, log-normal spread."""
    g = torch.Generator().manual_seed(seed)
    glob = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainable = frozenset(name for name, _ in model.named_parameters())
    sizes = torch.randint(200, 4000, (clients,), generator=g)
    updates = []
    for cid in range(clients):
        client_scale = math.exp(0.5 * float(torch.randn((), generator=g)))
        params = {}
        for name, t in glob.items():
            if not t.is_floating_point():
                params[name] = t + 225  # num_batches_tracked after one local epoch
                continue
            ref = float(t.float().std()) if t.numel() > 1 else 0.0
            scale = 0.01 * (ref + 1e-3) * client_scale
            pos_spread = torch.exp(0.5 * torch.randn(t.shape, generator=g))
            noise = scale * pos_spread * torch.randn(t.shape, generator=g)
            p = t + noise.to(t.dtype)
            if name.endswith("running_var"):
                p = p.abs()
            params[name] = p
        masks = CriticalMasks(0.5)(glob, params, trainable)  # FedCAC's upload; the other methods ignore it
        updates.append(Upload(cid, params, int(sizes[cid]), extras=masks))
    return stack_uploads(updates, rnd=1, global_params=glob, trainable=trainable, label_hists=np.zeros((clients, 10)))


def to_device(rin: RoundInput, device: torch.device) -> RoundInput:
    return RoundInput(
        round=rin.round,
        cids=rin.cids,
        params={k: v.to(device) for k, v in rin.params.items()},
        num_samples=rin.num_samples,
        extras={k: v.to(device) for k, v in rin.extras.items()},
        global_params={k: v.to(device) for k, v in rin.global_params.items()},
        trainable=rin.trainable,
        label_hists=rin.label_hists,
    )


def sgd_step_time(model: nn.Module, s: Setting, device: torch.device, steps: int, batch: int) -> float:
    """Median seconds per SGD step (forward, backward, update) of batch ``batch`` on random input."""
    model = model.to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.005)
    x = torch.randn(batch, s.in_channels, s.image_size, s.image_size, device=device)
    y = torch.randint(0, s.num_classes, (batch,), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return timed(step, device, steps, warmup=3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="1 aggregation repeat, 5 SGD steps")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3, help="aggregation repeats (median)")
    p.add_argument("--steps", type=int, default=20, help="SGD steps timed per model (median)")
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--models", default="cnn,resnet18", help="comma-separated subset of cnn,resnet18")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats, steps = (1, 5) if args.quick else (args.repeats, args.steps)
    device = torch.device(args.device)
    wanted = {m.strip() for m in args.models.split(",")}
    print(
        f"device {device}, torch threads {torch.get_num_threads()}, {args.clients} clients, "
        f"aggregation median of {repeats}, SGD step median of {steps} (batch {args.batch_size}, lr 0.005)"
    )
    print(
        "local-training round = clients x ceil(samples per client / batch) x median step time; samples per "
        "client from PFLlib's 75% split over 20 clients (MNIST 2,625; CIFAR-10 Dir(0.1) 2,250)\n"
    )

    fedavg = Aggregation(SampleWeights(), WeightedMean())
    fedsa = Aggregation(SampleWeights(), FedSACombine())
    personalized = {"FedCAC": FedCAC(SampleWeights()), "FedAMP": FedAMP(SampleWeights())}
    rows, prows = [], []
    for s in SETTINGS:
        if s.model not in wanted:
            continue
        torch.manual_seed(0)
        try:
            model = build_model(s.model, in_channels=s.in_channels, image_size=s.image_size, num_classes=s.num_classes)
        except ValueError as err:  # a model zoo without this architecture
            print(f"skipped: {s.label} ({err})")
            continue
        n_params = sum(p.numel() for p in model.parameters())
        rin = to_device(client_round(model, args.clients, seed=1), device)
        t_avg = timed(lambda rin=rin: fedavg.aggregate(rin, fedavg.init(None)), device, repeats)
        t_sa = timed(lambda rin=rin: fedsa.aggregate(rin, fedsa.init(None)), device, repeats)
        for pname, strat in personalized.items():
            t_p = timed(lambda rin=rin, strat=strat: strat.aggregate(rin, strat.init(None)), device, repeats)
            prows.append((s.label, pname, t_avg, t_p))
        out, _ = fedsa.aggregate(rin, fedsa.init(None))
        high_frac = out.diagnostics["fedsa_high_frac"]
        n_high = sum(v["H"] for v in out.diagnostics["fedsa"].values())
        n_layers = len(out.diagnostics["fedsa"])
        step = sgd_step_time(model, s, device, steps, args.batch_size)
        t_round = args.clients * math.ceil(s.samples_per_client / args.batch_size) * step
        rows.append((s.label, n_params, n_layers, n_high, high_frac, t_avg, t_sa, step, t_round))
        print(f"done: {s.label}")

    print()
    print(
        "| model | params | layers | high positions (H/M) | FedAvg agg s | FedSA agg s | FedSA/FedAvg "
        "| SGD step ms | local round s | FedSA % of round | FedSA-FedAvg % of round |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, n, layers, h, frac, ta, ts, st, tr in rows:
        print(
            f"| {label} | {n:,} | {layers} | {h} ({100 * frac:.4f}%) | {ta:.3f} | {ts:.3f} | {ts / ta:.2f} "
            f"| {1e3 * st:.1f} | {tr:.1f} | {100 * ts / tr:.3f}% | {100 * (ts - ta) / tr:.3f}% |"
        )
    print()
    print("| model | personalized server step | FedAvg agg s | its agg s | ratio to FedAvg |")
    print("|---|---|---|---|---|")
    for label, pname, ta, tp in prows:
        print(f"| {label} | {pname} | {ta:.3f} | {tp:.3f} | {tp / ta:.2f} |")


if __name__ == "__main__":
    main()
