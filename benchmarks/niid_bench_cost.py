"""Where a NIID-Bench run's time goes on this CPU, and how close it comes to the machine's arithmetic limit.

A run at NIID-Bench's published settings (``fedskew reproduce niid-bench --scale paper``): 10 clients holding the
60,000 MNIST training images, 10 local epochs, 50 rounds = 30 M sample passes of the simple CNN (``lenet``), plus 50
evaluations of the 10,000 test images. Measured here in one process on MNIST-shaped random data (speed does not depend
on the pixels), every variant against the references of the same run:

- **the arithmetic limit**: the fp32 rate of a dense 1024x1024 matmul at each thread count (the best a dense kernel
  reaches on this machine, not a datasheet peak);
- **the work**: the simple CNN's multiply-adds per sample, counted by hooks on every conv and linear layer (a training
  pass is taken as 3x the forward: 2 FLOP per multiply-add);
- **fedskew's local training** (:func:`fedskew.client.local.local_train` of FedAvg's client part, batch 64, SGD
  momentum 0.9, weight decay 1e-5, one epoch of one client's 6,000 samples) in samples/s, per thread count and memory
  format, and the same steps split into forward, backward and optimizer step (a separately timed loop);
- **a plain PyTorch loop** over the same batches (``torch.optim.SGD``): fedskew's overhead over it;
- **the evaluation** of 10,000 images;
- **whole rounds** (``--round-workers``): one NIID-Bench round (10 clients, Dir(0.5), 1 local epoch, evaluation) of
  ``fedskew``'s simulation on MNIST-shaped random data, with the clients trained in 1 process and in ``--workers``
  processes (``fedskew run --workers N``: the clients of a round spread over N forked processes, identical numbers),
  and batched in one process (``fedskew run --batched-clients``: the 10 clients as rows of one vmapped step, equal up
  to float rounding; meant for a GPU, measured here to say what it does on a CPU).

It prints the estimated time of one run at the published settings, the training's fraction of the matmul rate, and
every variant's speed relative to the default (1 thread, contiguous).

    python benchmarks/niid_bench_cost.py                # threads 1 and all cores, contiguous and channels-last
    python benchmarks/niid_bench_cost.py --samples 640 --repeats 1 --round-workers 0   # the CI-sized check
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fedskew.client.local import LocalContext, TrainSettings, local_train
from fedskew.methods import resolve_method
from fedskew.models import build_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import macs_per_sample  # noqa: E402  (the multiply-adds of a model, counted by hooks)

PASSES = 10 * 50  # local epochs x rounds: every training image passes this many times in a run
TRAIN, TEST = 60_000, 10_000


def matmul_gflops(threads: int, n: int = 1024, repeats: int = 5) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def fedskew_epoch(model: nn.Module, x: torch.Tensor, y: torch.Tensor, settings: TrainSettings) -> float:
    method = resolve_method("fedavg", {})
    received = {k: v.clone() for k, v in model.state_dict().items()}
    ctx = LocalContext(0, 1, model, received, {}, {}, settings)
    t0 = time.perf_counter()
    local_train(method.client, ctx, x, y, torch.Generator().manual_seed(0))
    return time.perf_counter() - t0


def plain_epoch(model: nn.Module, x: torch.Tensor, y: torch.Tensor, bs: int) -> tuple[float, dict[str, float]]:
    """The same steps in plain PyTorch, timed whole and split into forward, backward and step (synchronous CPU)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    parts = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    t0 = time.perf_counter()
    for i in range(0, x.shape[0], bs):
        idx = perm[i : i + bs]
        a = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        b = time.perf_counter()
        loss.backward()
        c = time.perf_counter()
        opt.step()
        d = time.perf_counter()
        parts["forward"] += b - a
        parts["backward"] += c - b
        parts["step"] += d - c
    return time.perf_counter() - t0, parts


def evaluation(model: nn.Module, x: torch.Tensor, bs: int = 1000) -> float:
    model.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, x.shape[0], bs):
            model(x[i : i + bs])
    model.train()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=6000, help="one client's training samples (NIID-Bench: ~6,000)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed epochs per variant (the median is kept)")
    p.add_argument("--threads", default=f"1,{os.cpu_count() or 1}", help="thread counts, comma-separated")
    p.add_argument(
        "--round-workers", type=int, default=os.cpu_count() or 1, help="whole rounds with this many processes too"
    )
    args = p.parse_args()
    threads = sorted({max(1, int(t)) for t in args.threads.split(",")})
    g = torch.Generator().manual_seed(0)
    x = torch.rand(args.samples, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (args.samples,), generator=g)
    x_test = torch.rand(TEST, 1, 28, 28, generator=g)
    settings = TrainSettings(epochs=1, batch_size=args.batch, lr=0.01, momentum=0.9, weight_decay=1e-5)
    torch.manual_seed(0)
    base = build_model("lenet", in_channels=1, image_size=28, num_classes=10)
    flop = 3 * 2 * macs_per_sample(base, x)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores; simple CNN (lenet): {flop / 6:,.0f} multiply-adds")
    print(f"per sample forward; a training pass ~{flop / 1e6:.2f} MFLOP; a run: {TRAIN * PASSES / 1e6:.0f} M passes")
    print()
    default = None
    rows = []
    for t in threads:
        peak = matmul_gflops(t)
        for channels_last in (False, True):
            torch.set_num_threads(t)
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            model = build_model("lenet", in_channels=1, image_size=28, num_classes=10).to(memory_format=fmt)
            xs = x.contiguous(memory_format=fmt)
            fedskew_epoch(model, xs[: args.batch * 4], y[: args.batch * 4], settings)  # warm-up
            ours = statistics.median(fedskew_epoch(model, xs, y, settings) for _ in range(args.repeats))
            plain, parts = plain_epoch(model, xs, y, args.batch)
            ev = evaluation(model, x_test.contiguous(memory_format=fmt))
            rate = args.samples / ours
            run_s = TRAIN * PASSES / rate + 50 * ev
            default = default or rate
            frac = rate * flop / 1e9 / peak
            split = ", ".join(f"{k} {v / sum(parts.values()):.0%}" for k, v in parts.items())
            rows.append((t, channels_last, rate, ours / plain, run_s, frac, peak, split))
            print(
                f"threads {t}, {'channels-last' if channels_last else 'contiguous'}: {rate:,.0f} samples/s "
                f"({rate / default:.2f}x the default), fedskew/plain loop {ours / plain:.2f}; a run at the published "
                f"settings ~{run_s / 60:.0f} min; {rate * flop / 1e9:.1f} GFLOP/s = {frac:.0%} of the "
                f"{peak:.0f} GFLOP/s matmul rate at {t} thread(s); steps: {split}; evaluation of 10,000 images "
                f"{ev:.2f} s"
            )
    best = max(rows, key=lambda r: r[2])
    print(
        f"\nfastest: threads {best[0]}, {'channels-last' if best[1] else 'contiguous'}: a run at the published "
        f"settings ~{best[4] / 60:.0f} min on this machine, {best[5]:.0%} of its matmul rate"
    )
    if args.round_workers > 1:
        rounds(args.round_workers)


def rounds(workers: int) -> None:
    """One NIID-Bench round (1 local epoch) with the clients in one process and in ``workers`` processes."""
    import tempfile
    from pathlib import Path

    import numpy as np

    from fedskew.config import make_config
    from fedskew.data.federated import build_federated
    from fedskew.engine.loop import Simulation

    g = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "mnist_shaped.npz"
        x, xt = (g.integers(0, 256, (n, 1, 28, 28), dtype=np.uint8) for n in (TRAIN, TEST))
        np.savez(path, x=x, y=g.integers(0, 10, TRAIN), x_test=xt, y_test=g.integers(0, 10, TEST))
        times = {}
        variants = {"one process": {"workers": 1}, f"--workers {workers}": {"workers": workers}}
        variants["--batched-clients"] = {"workers": 1, "batched_clients": True}
        for label, extra in variants.items():
            cfg = make_config(
                {"protocol": "niid-bench", "dataset": "npz", "data_dir": str(path), "local_epochs": 1, "rounds": 4}
                | {"threads": 1, "skew_probes": 0, "db": None}
                | extra
            )
            sim = Simulation(cfg, build_federated(cfg))
            try:
                sim.round(1)  # warm-up (forks the workers)
                spent = []
                for rnd in (2, 3, 4):
                    t0 = time.perf_counter()
                    sim.round(rnd)
                    spent.append(time.perf_counter() - t0)
                times[label] = statistics.median(spent)
            finally:
                sim.close()
        one = times["one process"]
        head = f"a NIID-Bench round of 1 local epoch (10 clients, {TRAIN:,} images, evaluation included; median of 3)"
        print(f"\n{head}:")
        for label, t in times.items():
            print(
                f"  {label}: {t:.1f} s ({one / t:.2f}x one process); a run at the published settings "
                f"(10 epochs x 50 rounds) ~{50 * 10 * t / 60:.0f} min"
            )


if __name__ == "__main__":
    main()
