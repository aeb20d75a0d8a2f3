"""The host's work in a batched round: how many PyTorch operations a round dispatches outside the training steps,
by the engine function that dispatches them, measured in one run.

On a GPU a round of the pfl-research-shaped workload with ``--capture-steps`` replays each step as one CUDA graph,
so what is left on the host is every other operation of the round: stacking the clients' models, their data and
schedules, the uploads' views, checks and copies into the round's stack, the aggregation. Each costs the host a
dispatch (and on a GPU a kernel launch when it computes) of a few microseconds whatever its size, so their count,
which is the same on every device, is the host cost a change can remove without a GPU to time it. The script runs
the workload's rounds under ``torch.profiler`` (CPU activity, Python stacks) after warm-up rounds and attributes
every outermost ``aten::`` operation to the innermost fedskew function on its stack; the operations inside a
captured step's body (``engine/captured.py``'s ``_step``: one graph replay on a GPU) are counted apart. On a CUDA
device it also times the same rounds unprofiled (the median round), and profiles one more round's device work
(CUPTI): the share of the round in which a kernel, copy or memset ran, and the kernels with the most time, which say
whether what is left of the round is the host's or the device's.

    python benchmarks/host_ops.py --data-dir ../shared/data/mnist            # the pfl-research shape, CPU
    python benchmarks/host_ops.py --data-dir ../shared/data/mnist --device cuda
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.engine.loop import Simulation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batched_clients import DeviceProfile, device_profile  # noqa: E402  (the device's own times, CUPTI)

OUTSIDE = "(outside fedskew)"


def attribute(events) -> tuple[collections.Counter, int]:
    """Each outermost ``aten::`` operation counted under the innermost fedskew function on its Python stack (the
    profiler's Python events are its ancestors); those inside a captured step's body are counted apart."""
    by: collections.Counter = collections.Counter()
    in_steps = 0
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        names, q = [], e.cpu_parent
        while q is not None:
            names.append(q.name)
            q = q.cpu_parent
        if any(n.startswith("aten::") for n in names):  # inside another operation: not dispatched by Python
            continue
        ours = [n for n in names if "fedskew/" in n]
        if any("captured.py" in n and "_step" in n for n in ours):
            in_steps += 1
            continue
        by[ours[0].split("fedskew/")[-1] if ours else OUTSIDE] += 1
    return by, in_steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="", help="the mnist/ folder (default: the embedded digits)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--join-ratio", type=float, default=0.05)
    p.add_argument("--model", default="cnn")
    p.add_argument("--method", default="fedavg")
    p.add_argument("--rounds", type=int, default=2, help="profiled rounds, after --warmup rounds")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-capture", action="store_true", help="the plain batched steps (no --capture-steps)")
    p.add_argument("--top", type=int, default=15, help="functions listed")
    args = p.parse_args()
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be at least 1 and --warmup 0 or more")
    data_args = {"dataset": "mnist", "data_dir": args.data_dir} if args.data_dir else {"dataset": "digits"}
    cfg = make_config(
        None,
        {
            **data_args,
            "partition": "iid",
            "clients": args.clients,
            "join_ratio": args.join_ratio,
            "local_epochs": 1,
            "lr": 0.05,
            "batch_size": 10,
            "model": args.model,
            "method": args.method,
            "skew_probes": 0,
            "device": args.device,
            "batched_clients": True,
            "capture_steps": not args.no_capture,
            "rounds": 2 * args.rounds + args.warmup + 1,
            "eval_every": 10**6,
        },
    )
    sim = Simulation(cfg, build_federated(cfg))
    for rnd in range(1, args.warmup + 1):
        sim.round(rnd)
    first = args.warmup + 1
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        for rnd in range(first, first + args.rounds):
            sim.round(rnd)
    by, in_steps = attribute(prof.events())
    total = sum(by.values())
    print(
        f"workload: {cfg.dataset}, {args.clients} clients, {args.join_ratio:g} a round, {args.model}, {args.method}, "
        f"batch 10, 1 epoch, {'plain batched steps' if args.no_capture else 'captured steps'}, device {args.device}; "
        f"torch {torch.__version__}"
    )
    print(
        f"operations a round outside the steps: {total / args.rounds:.0f} (inside the steps' bodies: "
        f"{in_steps / args.rounds:.0f}{', one graph replay a step on a GPU' if not args.no_capture else ''})"
    )
    if total and set(by) == {OUTSIDE}:  # torch 2.11 on CUDA recorded no Python frames (2026-12-04)
        print(f"  (the profiler recorded no Python frames of fedskew under torch {torch.__version__}: not attributed)")
    else:
        for name, n in by.most_common(args.top):
            print(f"{n / args.rounds:9.1f}  {name}")
    if args.device.startswith("cuda"):  # the same rounds' time, unprofiled
        times = []
        for rnd in range(first + args.rounds, first + 2 * args.rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sim.round(rnd)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        print(f"round time (unprofiled, median of {len(times)}): {median * 1000:.1f} ms")
        prof = device_profile(torch.device(args.device), lambda: sim.round(first + 2 * args.rounds))
        if isinstance(prof, DeviceProfile):
            share = prof.busy / median
            print(f"device busy (one profiled round, kernels' own times): {prof.busy * 1000:.1f} ms, {share:.0%} of")
            print("the unprofiled round; the device's work by kernel (share of the kernels' summed time):")
            print("\n".join(prof.lines(8)))
        else:
            print(f"device busy: {prof}")
    sim.close()


if __name__ == "__main__":
    main()
