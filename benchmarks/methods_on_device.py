"""Every registered method run for a few rounds on one device, sequential and batched: does each keep its tensors on
the run's device? A check to run first whenever a GPU is lent, since CI has none.

On a CUDA run the model, the uploads, their stack and the server's state live on the GPU; a tensor a method makes
without ``device=`` lives on the CPU, and the two meet in a crash ("Expected all tensors to be on the same device")
that no CPU test sees. FedDBE's client did that on the H200 (2026-12-04). This script runs each client part (with
fedavg's server) and each server plug-in (on fedavg's client) for ``--rounds`` rounds on the embedded digits data,
evaluated every round, once with the sequential loop and once with ``--batched-clients``, and prints one line a run:
``ok``, ``refused`` (the configuration was refused by name: a method that needs another model or data, or a path it
has no batched form for, which the engine says and falls back from) or ``FAILED`` with the error's last line. Exit
status 1 when any run failed. ``--paths captured`` runs ``--batched-clients --capture-steps`` (on a CUDA device the
steps captured as CUDA graphs and replayed, engine/captured.py): a method whose steps cannot run at one shape is
``refused`` with the engine's reason (it ran in buckets, as the batched path).

    python benchmarks/methods_on_device.py --device cuda                      # all of them (a few minutes)
    python benchmarks/methods_on_device.py --device cpu --methods fedavg,feddbe,fedavg+ccvr --rounds 2
    python benchmarks/methods_on_device.py --device cuda --paths captured     # every method's captured steps
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from fedskew.config import ConfigError, make_config
from fedskew.methods import CLIENTS, SERVER_PLUGINS, resolve_method
from fedskew.runner import run_experiment


def all_methods() -> list[str]:
    """Each client part alone (with the plug-ins it implies: FedDyn's ``cloud``), then each plug-in that reads any
    client part's uploads on fedavg's client (one that reads a particular client part's runs with that part)."""
    implied = {p for part in CLIENTS.values() for p in part.implies}
    free = [p for p, plugin in sorted(SERVER_PLUGINS.items()) if not plugin.clients and p not in implied]
    return [*sorted(CLIENTS), *(f"fedavg+{p}" for p in free)]


PATHS = ("sequential", "batched", "captured")
# what the engine warns when a path falls back (engine/backends.py): the captured path's runs that did not capture
FALLBACKS = ("batched_clients:", "capture_steps:")


def run_one(method: str, path: str, device: str, rounds: int, out: Path, precision: str = "float32") -> tuple[str, str]:
    """``(status, detail)`` of one run on ``path`` (:data:`PATHS`): ``ok`` with its accuracy, ``refused`` or
    ``FAILED`` with the reason."""
    try:
        cfg = make_config(
            {"db": None},  # no results database (a None override would mean "unset": the default database)
            {
                "dataset": "digits",
                "partition": "dir",
                "alpha": 0.5,
                "clients": 6,
                "rounds": rounds,
                "local_epochs": 1,
                "batch_size": 16,
                "method": method,
                "device": device,
                "batched_clients": path != "sequential",
                "capture_steps": path == "captured",
                "skew_probes": 0,
                "eval_every": 1,
                "validation": 0.2,  # FedFomo scores its peers on it; the others' validation paths run too
                "out": str(out),
                "seed": 0,
                "precision": precision,
            },
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outcome = run_experiment(cfg, overwrite=True)
        for w in caught:
            message = str(w.message)
            if path == "captured" and message.startswith(FALLBACKS):
                return "refused", " ".join(message.split())[:200]
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)  # the others, as before
    except ConfigError as e:
        return "refused", " ".join(str(e).split())[:200]
    except Exception as e:  # noqa: BLE001 - the point of the check: reported by name, the next method runs
        where = traceback.extract_tb(e.__traceback__)[-1]
        return (
            "FAILED",
            f"{type(e).__name__}: {str(e).splitlines()[0][:160]} ({Path(where.filename).name}:{where.lineno})",
        )
    acc = outcome.summary.get("global_acc", {}).get("final")
    return "ok", "" if acc is None else f"accuracy {acc:.3f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--methods", default="", help="comma-separated methods (default: every registered one)")
    p.add_argument("--rounds", type=int, default=2, help="rounds a run (2: a method's second-round state is used)")
    p.add_argument("--paths", default="sequential,batched", help="comma-separated: sequential, batched, captured")
    p.add_argument("--precision", default="float32", help="the runs' precision (float32 or bf16: client/precision.py)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    paths = [s.strip() for s in args.paths.split(",") if s.strip()]
    if not paths or set(paths) - set(PATHS):
        p.error(f"--paths takes {', '.join(PATHS)}, not {args.paths!r}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] or all_methods()
    for method in methods:  # a method named here must exist and compose
        try:
            resolve_method(method, {})
        except ConfigError as e:
            p.error(" ".join(str(e).split()))
    what = f"{len(methods)} methods x {len(paths)} paths on {args.device}"
    print(
        f"{what} (torch {torch.__version__}), {args.rounds} rounds each, the digits data over 6 clients, "
        f"precision {args.precision}"
    )
    failed = refused = 0
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedskew-methods-") as tmp:
        for i, method in enumerate(methods):
            for path in paths:
                t0 = time.perf_counter()
                where = Path(tmp) / f"r{i}{path}"
                status, detail = run_one(method, path, args.device, args.rounds, where, args.precision)
                failed += status == "FAILED"
                refused += status == "refused"
                print(f"{status:8s} {method:24s} {path:10s} {time.perf_counter() - t0:6.1f}s  {detail}", flush=True)
    ran = len(methods) * len(paths)
    print(
        f"methods on {args.device}: {ran - failed - refused} ok, {refused} refused, {failed} failed of {ran} runs "
        f"in {time.perf_counter() - t_all:.0f}s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
