"""Arithmetic in FLOP terms, for the benchmarks that say how close a run comes to its device.

- :func:`macs_per_sample`: a model's multiply-adds per sample in one forward pass, counted by hooks on every Conv2d
  and Linear layer (the layers that hold the arithmetic of fedskew's zoo);
- a training pass is taken as 3 forwards (forward, and the backward's two products), 2 FLOP per multiply-add;
- :func:`matmul_gflops`: the fp32 rate of a dense matmul on a device, measured in the same process: the reference a
  benchmark's rate is divided by (the best a dense kernel reaches on that device, not a datasheet figure); with
  ``dtype=torch.bfloat16`` the bfloat16 rate, the reference of a run under ``precision: bf16``;
- :func:`run_arithmetic`: the arithmetic of one round of a finished ``fedskew run`` (from its ``config.yaml``: the
  expected training samples of a round, and the evaluation's samples).

    python benchmarks/flops.py RUN_DIR [--device cuda]    # a run's GFLOP per round and the device's matmul rate
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn


def macs_per_sample(model: nn.Module, x: torch.Tensor) -> int:
    """Multiply-adds of one forward pass per sample: every Conv2d and Linear layer, counted from its output (``x``
    is moved to the model's device: a run's data may sit on the GPU while the counting model is built on the CPU)."""
    total = 0

    def hook(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(mod, nn.Conv2d):
            k = mod.in_channels // mod.groups * mod.kernel_size[0] * mod.kernel_size[1]
            total += out[0].numel() * k
        elif isinstance(mod, nn.Linear):
            total += out[0].numel() * mod.in_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Conv2d | nn.Linear)]
    device = next(model.parameters()).device
    with torch.no_grad():
        model(x[:1].to(device))
    for h in handles:
        h.remove()
    return total


def matmul_gflops(device: str = "cpu", n: int = 2048, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """The rate of a dense ``n x n`` matmul in ``dtype`` (float32 by default) on ``device`` (the best of ``repeats``
    after a warm-up)."""
    cuda = device.startswith("cuda")
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    best = float("inf")
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize()
        if i:  # the first is a warm-up
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def run_arithmetic(run_dir: str | Path) -> dict[str, float]:
    """The arithmetic of one round of the run in ``run_dir``: ``train_gflop`` (the expected sampled clients' training
    samples x local epochs x a training pass) and ``eval_gflop`` (the global test set and every client's own test
    split, one forward each, as fedskew's evaluation scores them), with the model's multiply-adds per sample."""
    from fedskew.config import load_yaml, make_config
    from fedskew.data.federated import build_federated
    from fedskew.engine.loop import resolve_model_name
    from fedskew.models import build_model

    # counted on the CPU whatever device the run trained on (its data need not be loaded onto a GPU to be counted)
    cfg = make_config(load_yaml(Path(run_dir) / "config.yaml"), {"db": None, "device": "cpu"})
    data = build_federated(cfg)
    name = resolve_model_name(cfg, data)
    model = build_model(name, in_channels=data.in_channels, image_size=data.image_size, num_classes=data.num_classes)
    macs = macs_per_sample(model, data.x_test[:1])
    sizes = [len(c.y_train) for c in data.clients]
    train_samples = cfg.join_ratio * sum(sizes) * cfg.local_epochs  # expected, over the sampled clients
    eval_samples = len(data.y_test) + len(data.local_y)
    evaluated = [r for r in range(1, cfg.rounds + 1) if r % cfg.eval_every == 0 or r == cfg.rounds]
    return {
        "macs_per_sample": float(macs),
        "train_gflop": train_samples * 6 * macs / 1e9,
        "eval_gflop": eval_samples * 2 * macs / 1e9,
        "rounds": float(cfg.rounds),
        "evaluations": float(len(evaluated)),
    }


def run_fraction(arithmetic: dict[str, float], mean_time_round: float, rate_gflops: float) -> dict[str, float]:
    """A run's arithmetic rate (its rounds' training and evaluations over its rounds' time) and that rate as a
    fraction of ``rate_gflops`` (the device's matmul rate measured in the same call)."""
    total = arithmetic["rounds"] * arithmetic["train_gflop"] + arithmetic["evaluations"] * arithmetic["eval_gflop"]
    gflops = total / (arithmetic["rounds"] * mean_time_round)
    return {
        "gflop_per_round": total / arithmetic["rounds"],
        "gflops": gflops,
        "fraction_of_matmul_rate": gflops / rate_gflops,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    a = run_arithmetic(args.run_dir)
    rate = matmul_gflops(args.device)
    print(
        f"{args.run_dir}: {a['macs_per_sample']:,.0f} multiply-adds a sample; a round: training {a['train_gflop']:.3f}"
        f" GFLOP, evaluation {a['eval_gflop']:.3f} GFLOP; dense fp32 matmul on {args.device}: {rate:.0f} GFLOP/s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
