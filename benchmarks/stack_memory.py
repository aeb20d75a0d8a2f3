"""Peak memory of one round's server side: uploads arriving, stacked as ``[K, ...]``, aggregated.

For each number of clients K and each server step (FedAvg, FedSA, FedHEAL) a fresh subprocess builds the MLP
(784-200-200-10, the MNIST "2NN") and K synthetic uploads (global model + client-specific noise, produced one at a
time as local training would), feeds them to the server the way the engine does, and runs the aggregation. It
prints the uploads' size (K × model bytes), the peak RSS increase over the whole step (Linux ``VmHWM``, reset
through ``/proc/self/clear_refs`` after the setup, minus ``VmRSS`` then; tracemalloc does not see torch), and the
ratio peak / upload. The minimum is about 1.0: the uploads have to be somewhere.

Paths (``--path``):

- ``engine`` (default): what ``Simulation.round`` does. Each upload is validated and copied into preallocated
  ``[K, ...]`` buffers (:class:`fedskew.server.uploads.UploadStack`) as soon as it is produced and then dropped. On a
  checkout without ``UploadStack`` (before the change) the engine kept the K per-client uploads in a list and
  stacked them afterwards, which is what this path then measures.
- ``list``: :func:`fedskew.server.uploads.stack_uploads` over a list of K uploads that stays alive (an API caller).

FedHEAL's server state (one int32 sign-count table per client, the size of its model in float32) is part of the
round's output; it is built beforehand for the K clients (as after an earlier round) and the ``state`` column gives
the size of the new table the round allocates, which the peak includes (the previous one is in the baseline).

    python benchmarks/stack_memory.py                          # 10, 100, 1000 clients; FedAvg, FedSA, FedHEAL
    python benchmarks/stack_memory.py --clients 10,100 --quick
    PYTHONPATH=/path/to/other/src python benchmarks/stack_memory.py --src /path/to/other/src   # another checkout
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

METHODS = ("fedavg", "fedsa", "heal")


def _masking(state: Any) -> Any:
    return state.masking if hasattr(state, "masking") else state["masking"]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def child(method: str, clients: int, path: str, seed: int) -> dict:
    import numpy as np
    import torch

    from fedskew.models import build_model
    from fedskew.server import api, heal

    try:
        from fedskew.protocol import ServerContext, Upload
    except ImportError:  # --src of a checkout from before fedskew/protocol.py
        from fedskew.server.api import ServerContext, Upload
    from fedskew.catalog.fedsa import FedSACombine
    from fedskew.server.api import Aggregation
    from fedskew.server.combine import WeightedMean
    from fedskew.server.weights import SampleWeights

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = build_model("mlp", in_channels=1, image_size=28, num_classes=10)
    glob = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainable = frozenset(n for n, _ in model.named_parameters())
    model_bytes = sum(t.numel() * t.element_size() for t in glob.values())
    ctx = ServerContext(
        num_clients=clients,
        num_classes=10,
        template=glob,
        trainable=trainable,
        num_train=np.full(clients, 100),
        label_hists=np.ones((clients, 10)),
    )
    strategy = {
        "fedavg": lambda: Aggregation(SampleWeights(), WeightedMean()),
        "fedsa": lambda: Aggregation(SampleWeights(), FedSACombine()),
        "heal": heal.heal_aggregation,
    }[method]()
    state = strategy.init(ctx)
    g = torch.Generator().manual_seed(seed)
    if method == "heal":  # every client has participated 3 times before (tables in the dtype fedskew keeps them)
        dtype = heal.count_dtype(4) if hasattr(heal, "count_dtype") else torch.int32
        tables = {
            c: heal.SignHistory({n: torch.randint(0, 4, t.shape, generator=g, dtype=dtype) for n, t in glob.items()}, 3)
            for c in range(clients)
        }
        # an AggregationState (typed, since issue 32) or the dict of older sources (--src)
        state = state._replace(masking=tables) if hasattr(state, "_replace") else {**state, "masking": tables}
    scales = torch.exp(0.5 * torch.randn(clients, generator=g))

    def upload(cid: int) -> Upload:  # global + client noise, log-normal spread over clients and positions
        params = {}
        for n, t in glob.items():  # in place: one temporary, like the one snapshot local training makes
            p = torch.randn(t.shape, generator=g)
            p.mul_(torch.randn(t.shape, generator=g).mul_(0.5).exp_())
            params[n] = p.mul_(0.01 * float(scales[cid]) * (float(t.std()) + 1e-3)).add_(t)
        return Upload(cid, params, 100 + cid % 50)

    def server_step(k: int, state):
        """The server side of one round with ``k`` uploads, as the engine (or an API caller) runs it."""
        hists = np.ones((k, 10))
        if streaming:
            stack = api.UploadStack(k, glob)
            for cid in range(k):
                u = upload(cid)
                rejected = stack.add(u)
                assert rejected is None, rejected
                del u
            rin = stack.round_input(rnd=4, trainable=trainable, label_hists=hists)
            del stack
        else:
            updates = [upload(cid) for cid in range(k)]
            rin = api.stack_uploads(updates, rnd=4, global_params=glob, trainable=trainable, label_hists=hists)
        return strategy.aggregate(rin, state)

    streaming = path == "engine" and hasattr(api, "UploadStack")
    server_step(2, state)  # warm-up: the kernels' code and thread pools are loaded before the baseline
    with contextlib.suppress(OSError):  # give memory freed by the setup back to the OS: the baseline is what is live
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    reset = _reset_peak()
    base = _status_kib("VmRSS") if reset else _status_kib("VmHWM")
    _, new_state = server_step(clients, state)
    peak = _status_kib("VmHWM")
    state_bytes = 0
    if method == "heal":
        state_bytes = sum(t.numel() * t.element_size() for h in _masking(new_state).values() for t in h.nonneg.values())
    return {
        "method": method,
        "clients": clients,
        "path": path if (streaming or path == "list") else "engine (list, before UploadStack)",
        "upload_bytes": clients * model_bytes,
        "peak_bytes": (peak - base) * 1024,
        "state_bytes": state_bytes,
        "peak_reset": reset,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="10,100,1000", help="comma-separated numbers of clients")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--path", choices=("engine", "list"), default="engine")
    p.add_argument("--quick", action="store_true", help="10 and 100 clients only, FedAvg and FedHEAL")
    p.add_argument("--src", default=None, help="import fedskew from this src/ directory (another checkout)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object per setting instead of the table")
    p.add_argument("--child", nargs=2, metavar=("METHOD", "K"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.src:
        sys.path.insert(0, args.src)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.path, args.seed)))
        return
    clients = [int(c) for c in args.clients.split(",") if c]
    methods = [m for m in args.methods.split(",") if m]
    if args.quick:
        clients = [c for c in clients if c <= 100] or clients[:1]
        methods = [m for m in methods if m != "fedsa"] or methods[:1]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    env = dict(os.environ)
    if args.src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.src, env.get("PYTHONPATH")]))
    if not args.json:
        print(f"{'method':8} {'clients':>7} {'upload MB':>10} {'peak MB':>9} {'state MB':>9} {'peak/upload':>12}  path")
    for k in clients:
        for method in methods:
            cmd = [sys.executable, __file__, "--child", method, str(k), "--path", args.path, "--seed", str(args.seed)]
            if args.src:
                cmd += ["--src", args.src]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if res.returncode != 0:
                print(f"{method} K={k}: failed\n{res.stderr[-2000:]}", file=sys.stderr)
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            if args.json:
                print(json.dumps(r))
                continue
            mb = 1 / 2**20
            note = "" if r["peak_reset"] else " (VmHWM not resettable: peak over the setup's)"
            print(
                f"{method:8} {k:>7} {r['upload_bytes'] * mb:>10.1f} {r['peak_bytes'] * mb:>9.1f} "
                f"{r['state_bytes'] * mb:>9.1f} {r['peak_bytes'] / r['upload_bytes']:>12.2f}  {r['path']}{note}"
            )


if __name__ == "__main__":
    main()
