"""The stacked convolution's form, timed: which way of convolving K clients' batches at once is fastest on this device?

``engine/stacked.py`` convolves K clients as one grouped convolution (their channels side by side, ``groups = K``).
On the H200 the pfl-research-shaped round (50 clients, batch 10, PFLlib's CNN) ran its kernels at 6–7% of the fp32
matmul rate (docs/design.md), so the convolutions' form may be what is left between the round and the device. This
script times one training step's forward and backward of PFLlib's CNN's two convolutions (5×5, 1→32 on 28×28, then
32→64 on 12×12) for K clients of B samples in each form, in the same run:

* ``grouped``: the engine's default form (``stacked_conv: grouped``), cuDNN's (or oneDNN's) grouped convolution;
* ``grouped+benchmark``: the same with ``torch.backends.cudnn.benchmark`` (cuDNN times its algorithms per shape; a
  GPU only);
* ``grouped+channels_last``: the grouped convolution on channels-last input and filters (``stacked_conv: grouped``
  with ``channels_last``);
* ``unfold+bmm``: the engine's ``stacked_conv: unfold``, im2col (``F.unfold``) and one batched matmul over the
  clients, ``[K, O, C·k·k] @ [K, C·k·k, B·L]``;
* ``loop``: the engine's ``stacked_conv: per_client``, one ordinary convolution per client (the sequential loop's
  kernels, K launches; a captured step replays them without the host);
* ``grouped+bf16``, ``unfold+bmm+bf16``: the grouped and unfolded forms under bfloat16 autocast (``precision: bf16``,
  ``client/precision.py``; outputs within bfloat16's rounding of grouped's, about 1e-2).

Each form's outputs are checked against ``grouped``'s (float32 rounding), and each time is the median of
``--repeats`` synchronized steps after a warm-up, printed with its ratio to ``grouped``'s measured in the same run;
then each layer alone in each form, as its ratio to grouped's for that layer (whether the best form differs by layer).

    python benchmarks/conv_forms.py --device cuda                 # the pfl shape (K 50) and issue 15's (K 100)
    python benchmarks/conv_forms.py --device cpu --clients 4 --batch 2 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.client.precision import autocast
from fedskew.engine.stacked import CONV_FORMS

# PFLlib's CNN on MNIST: (input channels, output channels, input side), 5×5 kernels, no padding
LAYERS = ((1, 32, 28), (32, 64, 12))


# the layers' settings (kernel, stride, padding) as the engine reads them from a Conv2d: made once, not per step
CONVS = {(c, o): nn.Conv2d(c, o, 5) for c, o, _ in LAYERS}


def engine_form(name: str) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The engine's own form (``engine/stacked.py``'s :data:`CONV_FORMS`) for one of :data:`LAYERS`."""

    def form(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return CONV_FORMS[name](CONVS[(w.shape[2], w.shape[1])], x, w, b)

    return form


grouped, unfold_bmm = engine_form("grouped"), engine_form("unfold")
grouped_cl, loop = engine_form("grouped_channels_last"), engine_form("per_client")


def step(
    form: Callable[[Tensor, Tensor, Tensor], Tensor], xs: list[Tensor], params: list[Tensor], bf16: bool = False
) -> list[Tensor]:
    """Each layer's forward, ReLU and 2×2 max-pool as the CNN does (under bfloat16 autocast with ``bf16``), and the
    backward of their outputs' sum of squares: the layers' outputs (for the check, in float32)."""
    outs, loss = [], None
    for x, (w, b) in zip(xs, zip(params[0::2], params[1::2], strict=True), strict=True):
        with autocast(x.device, "bf16" if bf16 else "float32"):
            y = form(x, w, b)
            k, n = y.shape[0], y.shape[1]
            pooled = F.max_pool2d(F.relu(y.reshape(k * n, *y.shape[2:])), 2)
            loss = pooled.float().square().sum() if loss is None else loss + pooled.float().square().sum()
        outs.append(y.detach().float())
    assert loss is not None
    loss.backward()
    return outs


def timed(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: cuDNN's algorithm search, oneDNN's primitives, the allocator
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    device: torch.device, k: int, n: int, repeats: int, tf32: bool
) -> list[tuple[str, float, float, list[float]]]:
    """``(form, seconds, largest difference from grouped's outputs, seconds of each layer alone)`` for K clients of
    ``n`` samples (each layer alone: whether the fastest form differs by layer, as a per-layer choice would use)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(k, n, c, s, s, generator=g).to(device) for c, _, s in LAYERS]
    params = []
    for c, o, _ in LAYERS:
        params.append((0.1 * torch.randn(k, o, c, 5, 5, generator=g)).to(device).requires_grad_())
        params.append((0.1 * torch.randn(k, o, generator=g)).to(device).requires_grad_())
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    forms: list[tuple[str, Callable, bool, bool]] = [("grouped", grouped, False, False)]  # (name, form, bench, bf16)
    forms += [("grouped+channels_last", grouped_cl, False, False)]
    forms += [("unfold+bmm", unfold_bmm, False, False), ("loop", loop, False, False)]
    forms += [("grouped+bf16", grouped, False, True), ("unfold+bmm+bf16", unfold_bmm, False, True)]
    if device.type == "cuda":
        forms.insert(1, ("grouped+benchmark", grouped, True, False))
    reference = step(grouped, xs, params)
    found = []
    for name, form, bench, bf16 in forms:
        torch.backends.cudnn.benchmark = bench
        try:
            outs = step(form, xs, params, bf16)
            diff = max(float((a - r).abs().max()) for a, r in zip(outs, reference, strict=True))
            both = timed(device, lambda form=form, bf16=bf16: step(form, xs, params, bf16), repeats)
            alone = [
                timed(device, lambda f=form, b=bf16, i=i: step(f, [xs[i]], params[2 * i : 2 * i + 2], b), repeats)
                for i in range(len(LAYERS))
            ]
            found.append((name, both, diff, alone))
        finally:
            torch.backends.cudnn.benchmark = False
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--clients", default="50,100", help="K values (50: the pfl-research shape, 100: issue 15's)")
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tf32", default="off,on", help="off, on or both (cuDNN's and matmul's TF32; a GPU only)")
    args = p.parse_args()
    if args.repeats < 1 or args.batch < 1:
        p.error("--repeats and --batch must be at least 1")
    try:
        ks = [int(v) for v in args.clients.split(",") if v.strip()]
    except ValueError:
        p.error(f"--clients takes comma-separated counts, not {args.clients!r}")
    if not ks or min(ks) < 1:
        p.error("--clients needs counts of at least 1")
    modes = [m.strip() for m in args.tf32.split(",") if m.strip()]
    if not modes or set(modes) - {"off", "on"}:
        p.error(f"--tf32 takes off and/or on, not {args.tf32!r}")
    device = torch.device(args.device)
    if device.type != "cuda":
        modes = ["off"]  # TF32 is a GPU's
    if device.type == "cpu":
        torch.set_num_threads(1)
    print(f"PFLlib CNN's convolutions, forward + backward, batch {args.batch}, {device} (torch {torch.__version__})")
    for k in ks:
        for mode in modes:
            found = measure(device, k, args.batch, args.repeats, mode == "on")
            base = found[0][1]
            print(f"K {k}, TF32 {mode}:")
            for name, seconds, diff, _ in found:
                print(
                    f"  {name:22s} {seconds * 1e3:9.3f} ms  {base / seconds:6.2f}x grouped's speed  max diff {diff:.1e}"
                )
            for i, (c, o, side) in enumerate(LAYERS):  # each layer alone, against grouped's time for it
                speeds = ", ".join(f"{name} {found[0][3][i] / alone[i]:.2f}x" for name, _, _, alone in found)
                print(f"  layer {i + 1} ({c}->{o} on {side}x{side}): {speeds}")


if __name__ == "__main__":
    main()
