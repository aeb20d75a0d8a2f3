"""Batched clients (fedskew/engine/batched.py) against the sequential loop: speedup and equivalence, in one run.

Workload (issue 15, goal 3): the PFLlib CNN on MNIST-shaped data, PFLlib's split (protocol pfllib, Dir(0.1) over N
clients, 75% of each client's samples for training), batch 10, lr 0.005, 1 local epoch, FedAvg's local step. MNIST
is read from --data-dir (default ../shared/data/mnist beside the checkout, when present); without it the
script uses random uint8 28x28 images of MNIST's shape and counts (70,000 samples, 10 classes), which time the same.

Each repetition trains the same clients from the same received model twice, once one after another with
``Simulation._train`` (the sequential loop) and once with ``train_batched``, alternating which goes first; it prints
both times, the speedup (median over repetitions), the largest difference between the two paths' uploads, and on a
GPU the device's utilization during the batched training (``torch.cuda.utilization``, which needs pynvml; NVML's
window of 1/6 to 1 s reaches back before a short block, so its mean understates) and, from one more profiled round of
the batched path, the share of the batched time in which a kernel ran (the kernels' own start and end times).

    python benchmarks/batched_clients.py                            # CPU: 10 clients, 3% of their samples
    python benchmarks/batched_clients.py --clients 100 --fraction 1 # the goal's workload (the default on a GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from fedskew.commands.flags import parse_kv
from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.data.pools import FederatedData
from fedskew.data.readers import ImageDataset
from fedskew.engine import batched as batched_module
from fedskew.engine.batched import batchable, train_batched
from fedskew.engine.loop import Simulation
from fedskew.protocol import Upload

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import macs_per_sample, matmul_gflops  # noqa: E402  (a model's multiply-adds; a device's matmul rate)

DATA_DIRS = (Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist",)  # beside the checkout, when present


def random_mnist(seed: int) -> ImageDataset:
    """Random uint8 images and labels with MNIST's shape and counts (60,000 train, 10,000 test, 1x28x28)."""
    rng = np.random.default_rng(seed)
    return ImageDataset(
        "random-mnist",
        rng.integers(0, 256, (60_000, 1, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, 60_000).astype(np.int64),
        rng.integers(0, 256, (10_000, 1, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, 10_000).astype(np.int64),
        10,
    )


def shrink_clients(data: FederatedData, fraction: float) -> FederatedData:
    """Each client's first ``fraction`` of its training samples (at least one): a small CPU workload whose clients
    keep their unequal sizes (different step counts and last batches)."""
    clients = []
    for c in data.clients:
        n = max(1, round(fraction * c.x_train.shape[0]))
        clients.append(dataclasses.replace(c, x_train=c.x_train[:n], y_train=c.y_train[:n]))
    return dataclasses.replace(data, clients=clients)


def max_error(a: list[Upload], b: list[Upload]) -> float:
    """The largest absolute difference between two lists of uploads (parameters, buffers and numeric extras; boolean
    extras, FedCAC's masks, are counted by :func:`flipped` instead)."""
    err = 0.0
    for u, v in zip(a, b, strict=True):
        for k in u.params:
            err = max(err, (u.params[k].double() - v.params[k].double()).abs().max().item())
        for k in u.extras:
            if u.extras[k].dtype != torch.bool:
                err = max(err, (u.extras[k].double() - v.extras[k].double()).abs().max().item())
    return err


def flipped(a: list[Upload], b: list[Upload]) -> tuple[int, int]:
    """Boolean extras (FedCAC's critical masks): entries that differ between the two lists, and all entries. A mask
    is a threshold on a sensitivity, so float rounding of the trained model flips the entries at the threshold."""
    diff = total = 0
    for u, v in zip(a, b, strict=True):
        for k in u.extras:
            if u.extras[k].dtype == torch.bool:
                diff += int((u.extras[k] != v.extras[k]).sum())
                total += u.extras[k].numel()
    return diff, total


def one_ulp(t: torch.Tensor) -> torch.Tensor:
    """``t`` moved by one float ulp towards +inf (integer tensors unchanged)."""
    return torch.nextafter(t, torch.full_like(t, math.inf)) if t.is_floating_point() else t


class UtilizationSampler:
    """``torch.cuda.utilization()`` sampled every 20 ms in a thread while a block runs (GPU only, needs pynvml)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.samples: list[int] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> UtilizationSampler:
        if self.device.type != "cuda":
            self.error = "not a GPU run"
            return self
        try:
            torch.cuda.utilization(self.device)
        except Exception as exc:  # pynvml missing, or NVML not usable
            self.error = f"unavailable ({type(exc).__name__}: {exc})"
            return self
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(int(torch.cuda.utilization(self.device)))
            time.sleep(0.02)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals in microseconds, in seconds: the time in which at least
    one of them ran (kernels on different streams overlap; each instant counts once)."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total / 1e6


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What the device did while a block ran: ``busy`` seconds in which a kernel, copy or memset ran (their union),
    and ``top``, the kernels (copies, memsets) with the most device time: ``(name, seconds, count)``."""

    busy: float
    top: list[tuple[str, float, int]]

    def lines(self, n: int = 6) -> list[str]:
        total = sum(t for _, t, _ in self.top) or 1.0
        return [f"  {t * 1e3:9.2f} ms  {t / total:4.0%}  x{c:<6d} {name[:90]}" for name, t, c in self.top[:n]]


def device_profile(device: torch.device, fn: Callable[[], object]) -> DeviceProfile | str:
    """``fn()`` run once under the profiler's CUDA activity (CUPTI), from the device's work's own start and end times
    (:class:`DeviceProfile`), or why that cannot be measured. Unlike NVML's sampled utilization this has no averaging
    window reaching back before the block; the tracing itself slows the host's launches, so divide by the block's
    unprofiled time."""
    if device.type != "cuda":
        return "not a GPU run"
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        work = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    except Exception as exc:  # noqa: BLE001 - CUPTI unavailable: reported, the benchmark goes on
        return f"unavailable ({type(exc).__name__}: {exc})"
    if not work:
        return "unavailable (the profiler recorded no device activity)"
    return DeviceProfile(union_seconds([(e.time_range.start, e.time_range.end) for e in work]), top_work(work))


def top_work(events) -> list[tuple[str, float, int]]:
    """Device events (with ``name`` and ``time_range`` in µs) summed by name, the most time first."""
    by: dict[str, list[float]] = {}
    for e in events:
        by.setdefault(e.name, []).append((e.time_range.end - e.time_range.start) / 1e6)
    return sorted(((n, sum(ts), len(ts)) for n, ts in by.items()), key=lambda r: -r[1])


def timed(device: torch.device, fn: Callable[[], list[Upload]]) -> tuple[float, float, list[Upload]]:
    """Wall seconds (the device synchronized), this process's CPU seconds, and ``fn()``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, time.process_time() - c0, out


def main() -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="MNIST folder (default: the shared copy when present)")
    p.add_argument(
        "--random-data",
        action="store_true",
        help="random images of MNIST's shape and counts instead of MNIST (a workload that is the same on every "
        "machine, whatever data it holds: the GPU run book's --smoke)",
    )
    p.add_argument("--clients", type=int, default=100 if cuda else 10)
    p.add_argument(
        "--fraction", type=float, default=1.0 if cuda else 0.03, help="share of each client's training samples used"
    )
    p.add_argument("--method", default="fedavg", help="a batchable method (fedavg, fedprox, scaffold, ...)")
    p.add_argument(
        "--method-arg", "-m", action="append", default=[], metavar="KEY=VALUE", help="method hyper-parameter"
    )
    p.add_argument("--model", default="cnn")
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.005)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats, after one warm-up")
    p.add_argument("--max-clients", type=int, default=None, help="train at most this many clients at once")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for both paths (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--noise-floor",
        action="store_true",
        help="also train sequentially from the received models moved by one float32 ulp: how far float rounding "
        "alone moves the sequential loop's result (a reference for the equivalence error)",
    )
    p.add_argument(
        "--tf32",
        action="store_true",
        help="let cuDNN convolutions use TF32 (torch's default on a GPU); without it both paths run full float32, so "
        "the equivalence error measures the batching, not TF32's 10-bit mantissa",
    )
    p.add_argument(
        "--path",
        choices=("auto", "vmap", "captured"),
        default="auto",
        help="the batched step: auto (the stacked autograd graph for Sequential models, else vmap), vmap always, or "
        "captured (every step at a few padded shapes, replayed as CUDA graphs on a GPU: --capture-steps)",
    )
    p.add_argument(
        "--stacked-conv",
        choices=("grouped", "unfold"),
        default="grouped",
        help="the stacked graph's convolutions: one grouped convolution, or unfolded patches times the filters in one "
        "batched matmul (the run's stacked_conv; benchmarks/conv_forms.py times the two alone)",
    )
    args = p.parse_args()
    if args.repeats < 0:
        p.error(f"--repeats must be 0 or more (timed repeats after the warm-up), got {args.repeats}")
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    captured, conv = args.path == "captured", args.stacked_conv
    if args.path == "vmap":
        from fedskew.engine.step_functions import vmap_step_function

        def vmap_always(
            model,
            names,
            mu,
            term=None,
            head_term=None,
            client_term=None,
            head_draw=None,
            conv=None,
            precision="float32",
        ):
            # (vmap batches a convolution itself)
            return vmap_step_function(model, names, mu, client_term, head_draw, precision)

        batched_module.step_function = vmap_always
    if args.threads:
        torch.set_num_threads(args.threads)

    data_dir = None if args.random_data else args.data_dir or next((str(d) for d in DATA_DIRS if d.is_dir()), None)
    cfg = make_config(
        None,
        {
            "dataset": "mnist",
            "data_dir": data_dir or "unused",
            "protocol": "pfllib",
            "partition": "dir",
            "alpha": 0.1,
            "clients": args.clients,
            "model": args.model,
            "method": args.method,
            "method_args": parse_kv(args.method_arg),
            "batch_size": args.batch_size,
            "lr": args.lr,
            "local_epochs": args.epochs,
            "device": args.device,
            "threads": args.threads,
            "seed": args.seed,
            "skew_probes": 0,
            "db": None,
        },
    )
    data = build_federated(cfg, None if data_dir else random_mnist(args.seed))
    if not 0 < args.fraction <= 1:
        raise SystemExit(f"--fraction must be in (0, 1], got {args.fraction}")
    if args.fraction < 1:
        data = shrink_clients(data, args.fraction)
    seq, bat = Simulation(cfg, data), Simulation(cfg, data)
    reason = batchable(bat.method, bat.model)
    if reason is not None:
        raise SystemExit(f"method {args.method!r} falls back to the sequential loop: {reason}")
    device = torch.device(args.device)
    sizes = [c.x_train.shape[0] for c in data.clients]
    steps = [-(-n // min(args.batch_size, n)) * args.epochs for n in sizes]
    print(
        f"{'MNIST ' + data_dir if data_dir else 'random MNIST-shaped data'}: {args.clients} clients, "
        f"{sum(sizes)} training samples (per client {min(sizes)}..{max(sizes)}), model {args.model}, "
        f"method {args.method}, batch {args.batch_size}, {args.epochs} epoch(s), device {device}, "
        f"torch threads {torch.get_num_threads()}, TF32 {'on' if args.tf32 else 'off'}, batched step {args.path}"
        f"{', convolutions unfolded' if args.stacked_conv == 'unfold' else ''}"
    )
    print(f"steps: {sum(steps)} sequential, {max(steps)} batched (the longest client)")
    if args.path == "captured":  # the rows the padded steps run (engine/captured.py) against the clients' real steps
        from fedskew.client.local import TrainSettings
        from fedskew.engine.padded_plan import padded_samples, step_widths

        widths = step_widths(np.asarray(steps))
        slots, real, shapes = padded_samples(sizes, TrainSettings(args.epochs, args.batch_size, args.lr))
        print(
            f"padded rows: {sum(widths)} client-steps run for {sum(steps)} real ones "
            f"({sum(widths) / sum(steps):.2f}x), at {len(set(widths))} widths; {slots} sample slots for {real} "
            f"real samples ({slots / real:.2f}x), at {shapes} step shapes"
        )
    # the plain SGD arithmetic of the clients' training (a method's own terms come on top): a training pass of a
    # sample is 3 forwards at 2 FLOP per multiply-add (benchmarks/flops.py)
    train_gflop = sum(sizes) * args.epochs * 6 * macs_per_sample(seq.model, data.x_test[:1].to(device)) / 1e9
    rate = matmul_gflops(args.device)
    print(f"arithmetic: {train_gflop:.3f} GFLOP of training; dense fp32 matmul on the device: {rate:.0f} GFLOP/s")

    cids = list(range(args.clients))
    rows, errors, flips = [], [], []
    for rep in range(args.repeats + 1):  # repeat 0 warms both paths up and is not timed into the medians
        # the same round for both: same generators, received models and broadcast
        rnd = rep + 1
        received = {c: seq.params_for(c) for c in cids}
        broadcast = seq.method.server_half.broadcast(seq.server_half_state)

        def sequential(received=received, broadcast=broadcast, rnd=rnd) -> list[Upload]:
            return [seq._train(c, rnd, received[c], broadcast) for c in cids]

        def batched(received=received, broadcast=broadcast, rnd=rnd) -> list[Upload]:
            return train_batched(bat, rnd, cids, received, broadcast, args.max_clients, captured, conv=conv)

        sampler = UtilizationSampler(device)
        if rep % 2 == 0:
            t_seq, c_seq, a = timed(device, sequential)
            with sampler:
                t_bat, c_bat, b = timed(device, batched)
        else:
            with sampler:
                t_bat, c_bat, b = timed(device, batched)
            t_seq, c_seq, a = timed(device, sequential)
        err = max_error(a, b)
        above = sum(max_error([u], [v]) > 1e-5 for u, v in zip(a, b, strict=True))
        floor = ""
        if args.noise_floor:
            nudged = {c: {k: one_ulp(v) for k, v in received[c].items()} for c in cids}
            ref = Simulation(cfg, data)
            moved = [ref._train(c, rnd, nudged[c], broadcast) for c in cids]
            moved_above = sum(max_error([u], [v]) > 1e-5 for u, v in zip(a, moved, strict=True))
            floor = f" | one-ulp sequential {max_error(a, moved):.2e} ({moved_above}/{len(cids)} clients > 1e-5)"
        util = (
            sampler.error
            if sampler.error or not sampler.samples
            else f"mean {statistics.mean(sampler.samples):.0f}%, max {max(sampler.samples)}%"
        )
        errors.append(err)
        flips.append(flipped(a, b))
        if rep or not args.repeats:  # without timed repeats the warm-up's times are all there is
            rows.append((t_seq, t_bat, c_seq, c_bat))
        label = f"repeat {rep}" if rep else "warm-up"
        print(
            f"{label}: sequential {t_seq:.3f}s (cpu {c_seq:.3f}s) | batched {t_bat:.3f}s (cpu {c_bat:.3f}s) | "
            f"speedup {t_seq / t_bat:.2f}x | max |difference| {err:.2e} ({above}/{len(cids)} clients > 1e-5){floor} | "
            f"GPU utilization (batched) {util}",
            flush=True,
        )
    t_seq, t_bat, c_seq, c_bat = (statistics.median(col) for col in list(zip(*rows, strict=True))[:4])
    which = "median" if args.repeats else "the warm-up alone, no timed repeats"
    print(
        f"\nspeedup batched/sequential: {t_seq / t_bat:.2f}x ({which}; sequential {t_seq:.3f}s, batched {t_bat:.3f}s)"
    )
    print(f"speedup in this process's CPU time: {c_seq / c_bat:.2f}x (the figure to read on a shared, busy machine)")
    print(f"max equivalence error: {max(errors):.2e} (every run, warm-up included)")
    print(
        f"fraction of the matmul rate: batched {train_gflop / t_bat / rate:.2%}, sequential "
        f"{train_gflop / t_seq / rate:.2%} ({train_gflop / t_bat:.1f} and {train_gflop / t_seq:.1f} GFLOP/s)"
    )
    if device.type == "cuda":  # one more round of the batched path, profiled: the device's busy share from its kernels
        rnd = args.repeats + 2
        received = {c: seq.params_for(c) for c in cids}
        broadcast = seq.method.server_half.broadcast(seq.server_half_state)
        prof = device_profile(
            device,
            lambda: train_batched(bat, rnd, cids, received, broadcast, args.max_clients, captured, conv=conv),
        )
        if isinstance(prof, DeviceProfile):
            print(
                f"device busy (batched, kernels' own times, one profiled round): {prof.busy / t_bat:.0%} of the "
                f"batched time ({prof.busy:.3f}s of kernels, copies and memsets)"
            )
            print("the device's work by kernel (one profiled round; share of the kernels' summed time):")
            print("\n".join(prof.lines()))
        else:
            print(f"device busy (batched, kernels' own times): {prof}")
    diff, total = (sum(col) for col in zip(*flips, strict=True))
    if total:
        print(f"mask entries that differ: {diff} of {total} (every run; entries at the threshold flip with rounding)")


if __name__ == "__main__":
    main()
