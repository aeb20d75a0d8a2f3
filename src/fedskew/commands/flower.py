"""``fedskew flower new|local|loopback``: fedskew's methods as a Flower app (docs/flower.md).

* ``new --config my.yaml DIR``: write a ready-to-run Flower app folder for a fedskew configuration (``flwr new`` needs
  the network; this needs nothing): its ``pyproject.toml`` names fedskew's ServerApp and ClientApp and holds the whole
  configuration as ``[tool.flwr.app.config]``, so ``flwr run --run-config`` can override any key;
* ``local --config my.yaml``: run the apps in this process on an in-process Grid (no network): the Flower path's run
  directory, to compare with ``fedskew run`` before going to real machines;
* ``check [METHOD ...]``: run each composition (default: every valid one) with ``fedskew run``'s runner and with the
  Flower apps in process on a small digits federation, and compare their metrics (all but the wall-clock times);
* ``loopback DIR``: a real deployment of app folder DIR on this machine (a SuperLink and one SuperNode per client, on
  127.0.0.1, every process stopped afterwards), ``flwr run`` included; ``--secure``: with TLS and SuperNode
  authentication, as across machines.

``flwr`` is imported only inside the handlers; without the extra they say how to install it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    from fedskew.commands.flags import RUN_FLAGS

    p.add_argument("--config", help="fedskew YAML file of settings (as `fedskew run --config`); flags override it")
    for flag, (_, typ, help_) in RUN_FLAGS.items():
        p.add_argument(flag, type=typ, default=None, help=help_)
    p.add_argument("--method-arg", "-m", action="append", default=[], metavar="KEY=VALUE", help="method argument")
    p.add_argument("--no-db", action="store_true", help="no results database")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--round-timeout", type=float, default=None, help="seconds a phase waits for replies (600)")
    p.add_argument(
        "--straggler-timeout",
        type=float,
        default=None,
        help="once a phase's first reply is in, seconds it waits for the others (default: only --round-timeout)",
    )
    p.add_argument("--node-wait", type=float, default=None, help="seconds the ServerApp waits for the nodes (300)")
    p.add_argument(
        "--node-data",
        action="store_true",
        help="a real federation: each node's data-dir holds its own data (e.g. --dataset npz), the server none "
        "(flower.data = node; docs/flower.md)",
    )
    p.add_argument(
        "--secagg",
        action="store_true",
        help="secure aggregation: the server sees each round's uploads only as their sum (Flower's SecAgg+; "
        "flower.secagg, docs/privacy.md)",
    )
    p.add_argument("--secagg-clip", type=float, default=None, help="with --secagg: the range ±C of summed values (8)")
    p.add_argument(
        "--secagg-threshold",
        type=float,
        default=None,
        help="with --secagg: the share of a round's clients needed to unmask it (0.67)",
    )
    p.add_argument(
        "--test-data",
        default=None,
        metavar="NPZ",
        help="with --node-data: a held-out test set on the server (x_test, y_test); default: federated evaluation",
    )


def _add_resource_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--num-cpus", type=float, default=None, help="simulation: CPUs per simulated client (default 1; Flower's is 2)"
    )
    p.add_argument(
        "--num-gpus",
        type=float,
        default=None,
        help="simulation: GPUs per simulated client (default 0; 0.25 when the configuration's device is cuda)",
    )


def add_parsers(sub: Any) -> None:
    fl = sub.add_parser(
        "flower",
        help="run fedskew methods on Flower: write an app folder, run it in-process or on a loopback deployment",
        description="fedskew's ServerApp and ClientApp run any method composition on Flower with the simulator's "
        'numbers (docs/flower.md). Needs the extra: pip install -e ".[flower]".',
    )
    fsub = fl.add_subparsers(dest="flower_command", required=True)
    new = fsub.add_parser(
        "new",
        help="write a ready-to-run Flower app folder for a fedskew configuration",
        description="Writes DIR/pyproject.toml (components: fedskew's ServerApp and ClientApp; [tool.flwr.app.config]: "
        "the whole resolved configuration, so that `flwr run --run-config` can override any key) and DIR/README.md.",
    )
    new.add_argument("dir", metavar="DIR", help="the app folder (created; must not hold a pyproject.toml)")
    new.add_argument(
        "--simulation",
        action="store_true",
        help="also write DIR/simulation.toml: a local-simulation federation for Flower's Simulation Engine (Ray), one "
        "simulated SuperNode per client (partition-id = client id); run it with `fedskew flower simulate DIR`",
    )
    _add_resource_flags(new)
    _add_config_flags(new)
    _add_engine_flags(new)

    sim = fsub.add_parser(
        "simulate",
        help="run app folder DIR on Flower's Simulation Engine (Ray): one simulated SuperNode per client, then stop it",
        description="flwr run DIR on a local-simulation federation in a throwaway FLWR_HOME (DIR/simulation.toml's "
        "resources when present), bounded by --timeout; stops the local SuperLink and Ray processes flwr leaves "
        'behind. Needs the extra: pip install -e ".[flower-sim]".',
    )
    sim.add_argument("dir", metavar="DIR", help="an app folder written by `fedskew flower new`")
    sim.add_argument("--run-config", default=None, metavar="'K=V ...'", help="overrides, as flwr run --run-config")
    sim.add_argument("--timeout", type=float, default=1800.0, help="seconds the run may take (default 1800)")
    _add_resource_flags(sim)

    loc = fsub.add_parser(
        "local",
        help="run the Flower apps in this process (in-process Grid, no network) and write the run directory",
    )
    _add_config_flags(loc)

    ck = fsub.add_parser(
        "check",
        help="compare the Flower path with the simulator for compositions (default: every valid one)",
        description="Runs each composition twice on the same configuration (default: digits, 4 clients, 3 rounds, "
        "join ratio 0.75, client dropout 0.2, so that state survives missed rounds): with `fedskew run`'s runner "
        "and with the Flower apps on an in-process Grid; lists every metric that differs by more than 1e-6.",
    )
    ck.add_argument("methods", nargs="*", metavar="METHOD", help="compositions to check (default: all valid ones)")
    _add_config_flags(ck)

    lb = fsub.add_parser(
        "loopback",
        help="deploy app folder DIR on this machine: SuperLink + one SuperNode per client on 127.0.0.1, flwr run",
    )
    lb.add_argument("dir", metavar="DIR", help="an app folder written by `fedskew flower new`")
    lb.add_argument("--run-config", default=None, metavar="'K=V ...'", help="overrides, as flwr run --run-config")
    lb.add_argument("--timeout", type=float, default=1800.0, help="seconds the run may take (default 1800)")
    lb.add_argument(
        "--secure",
        action="store_true",
        help="TLS (a throwaway CA and server certificate for 127.0.0.1) and SuperNode authentication (each node's "
        "key pair registered with `flwr supernode register`), as across machines; no --insecure anywhere",
    )


def _config(args: argparse.Namespace):
    """The run configuration from --config and the flags, as `fedskew run` reads them (with --node-data, the data
    directory is each node's own, so none is needed here)."""
    from fedskew.commands.flags import config_from_args
    from fedskew.flower.settings import NODE_DATA

    if getattr(args, "node_data", False) and not getattr(args, "data_dir", None):
        args.data_dir = NODE_DATA
    return config_from_args(args)


# the flags of FlowerSettings' fields, for an error that names what the user typed
SETTING_FLAGS = {
    "round_timeout": "--round-timeout",
    "straggler_timeout": "--straggler-timeout",
    "node_wait": "--node-wait",
    "secagg_clip": "--secagg-clip",
    "secagg_threshold": "--secagg-threshold",
}


def _settings(args: argparse.Namespace):
    from pydantic import ValidationError

    from fedskew.config import ConfigError
    from fedskew.flower.settings import FlowerSettings
    from fedskew.schema import describe_errors

    given = {
        "round_timeout": args.round_timeout,
        "straggler_timeout": args.straggler_timeout,
        "node_wait": args.node_wait,
        "data": "node" if getattr(args, "node_data", False) else None,
        "test_data": getattr(args, "test_data", None),
        "secagg": True if getattr(args, "secagg", False) else None,
        "secagg_clip": getattr(args, "secagg_clip", None),
        "secagg_threshold": getattr(args, "secagg_threshold", None),
    }
    if (given["secagg_clip"] is not None or given["secagg_threshold"] is not None) and not given["secagg"]:
        raise ConfigError("--secagg-clip and --secagg-threshold set up secure aggregation: they need --secagg")
    if given["test_data"] and given["data"] is None:
        raise ConfigError("--test-data is the server's held-out set of a real federation: it needs --node-data")
    try:
        return FlowerSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:  # e.g. --node-wait 0, a negative --round-timeout: the flag and its bound
        lines = describe_errors(exc)
        for key, flag in SETTING_FLAGS.items():
            lines = [f"{flag}:{line[len(key) + 1 :]}" if line.startswith(f"{key}:") else line for line in lines]
        raise ConfigError("; ".join(lines)) from None


def cmd_new(args: argparse.Namespace) -> int:
    import importlib.util

    from fedskew.flower.settings import write_app

    cfg = _config(args)
    folder = Path(args.dir)
    simulation = None
    if args.simulation:
        from fedskew.flower.simulation import connection

        num_gpus = args.num_gpus if args.num_gpus is not None else (0.25 if cfg.device.startswith("cuda") else 0.0)
        simulation = connection(cfg.clients, args.num_cpus or 1.0, num_gpus)
    elif args.num_cpus is not None or args.num_gpus is not None:
        from fedskew.config import ConfigError

        raise ConfigError("--num-cpus and --num-gpus are the simulated clients' resources: they need --simulation")
    settings = _settings(args)
    if settings.secagg:  # refused now, not when the federation runs
        from fedskew.flower.settings import check_secagg
        from fedskew.methods import resolve_method

        check_secagg(cfg, resolve_method(cfg.method, cfg.method_args))
    written = write_app(folder, cfg, settings, simulation=simulation)
    print(f"Flower app for fedskew {cfg.method} on {cfg.dataset} ({cfg.clients} clients, {cfg.rounds} rounds):")
    for path in written:
        print(f"  {path}")
    if simulation is not None:
        print(
            f'\nOn Flower\'s Simulation Engine (Ray; pip install -e ".[flower-sim]"): fedskew flower simulate {folder}'
        )
    print(
        "\nRun it (docs/flower.md):\n"
        "  flower-superlink --host 0.0.0.0 --port 8000 --disable-runtime-dependency-installation \\\n"
        "      --ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key    # the server machine\n"
        "  flower-supernode --superlink HOST:8000 --root-certificates ca.crt \\\n"
        f"      --node-config \"cid=K data-dir='/data'\"        # one per client machine, K = 0..{cfg.clients - 1}\n"
        f"  flwr run {folder} <connection> --stream --run-config \"out='/abs/run/dir'\"\n"
        f"or on this machine: fedskew flower loopback {folder}"
    )
    if importlib.util.find_spec("flwr") is None:
        from fedskew.flower import INSTALL_HINT

        print(f"note: {INSTALL_HINT}", file=sys.stderr)
    return 0


def cmd_local(args: argparse.Namespace) -> int:
    from fedskew.flower import require_flwr

    require_flwr()
    from fedskew.flower.inprocess import run_in_process

    cfg = _config(args)
    if not cfg.out:
        from fedskew.results.store import default_run_dir

        cfg = cfg.model_copy(update={"out": str(default_run_dir(cfg, time.strftime("%Y%m%d-%H%M%S") + "-flower"))})
    run_dir = run_in_process(cfg)
    db = f"; database {cfg.db}" if cfg.db else ""
    print(f"results: {run_dir}/ (config.yaml, metrics.jsonl, summary.json){db}")
    return 0


def _app_config(app_dir: Path, run_config: str | None) -> dict[str, Any] | None:
    """An app folder's ``[tool.flwr.app.config]`` with ``--run-config``'s ``K=V`` overrides (values as given);
    ``None``, after saying so, when the folder has no ``pyproject.toml``."""
    import tomllib

    project = app_dir / "pyproject.toml"
    if not project.is_file():
        print(f"error: {project} not found (write an app folder with `fedskew flower new`)", file=sys.stderr)
        return None
    config = dict(tomllib.loads(project.read_text())["tool"]["flwr"]["app"]["config"])
    return config | (dict(kv.split("=", 1) for kv in run_config.split()) if run_config else {})


def plain(text: str) -> str:
    """``text`` without terminal colour codes (Flower's log lines carry them; a pipe or a file should not)."""
    import re

    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)


def cmd_loopback(args: argparse.Namespace) -> int:
    import tempfile

    from fedskew.flower import require_flwr

    require_flwr()
    from fedskew.flower.loopback import Loopback

    app_dir = Path(args.dir)
    found = _app_config(app_dir, args.run_config)
    if found is None:
        return 2
    flower = found.get("flower")
    node_data = found.get("flower.data") or (flower.get("data") if isinstance(flower, dict) else None)
    if node_data == "node":
        print(
            f"error: {app_dir} reads each node's own data directory (flower.data = node, `flower new --node-data`), "
            "and the loopback starts its SuperNodes without one: run it on SuperNodes started with --node-config "
            "\"cid=K data-dir='/path/to/its/data'\" (docs/flower.md), or make the app without --node-data to try it "
            "here",
            file=sys.stderr,
        )
        return 2
    clients = int(found["clients"])
    with tempfile.TemporaryDirectory(prefix="fedskew-flower-") as home:
        t0 = time.perf_counter()
        with Loopback(Path(home), clients, secure=args.secure, workdir=Path.cwd()) as fed:
            mode = "TLS, SuperNode authentication" if args.secure else "insecure"
            up = f"SuperLink and {clients} SuperNodes up on 127.0.0.1:{fed.port} ({mode})"
            print(f"{up} in {time.perf_counter() - t0:.1f} s")
            t1 = time.perf_counter()
            argv = ["--run-config", args.run_config] if args.run_config else []
            out = fed.run_app(app_dir, None, timeout=args.timeout, extra_args=argv)
            print(out if sys.stdout.isatty() else plain(out))
            print(f"flwr run took {time.perf_counter() - t1:.1f} s")
        left = fed.leftovers()
    if left:
        print(f"warning: processes left behind: {left}", file=sys.stderr)
        return 1
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    import tempfile
    import tomllib

    from fedskew.flower import require_flwr

    require_flwr()
    from fedskew.flower.simulation import LocalSimulation

    app_dir = Path(args.dir)
    config = _app_config(app_dir, args.run_config)
    if config is None:
        return 2
    clients = int(config["clients"])
    resources = {"num_cpus": 1.0, "num_gpus": 0.25 if str(config.get("device", "cpu")).startswith("cuda") else 0.0}
    written = app_dir / "simulation.toml"
    if written.is_file():  # the resources `fedskew flower new --simulation` wrote
        options = tomllib.loads(written.read_text())["superlink"]["local-simulation"]["options"]
        resources = {f"num_{k[4:]}": float(v) for k, v in options["backend"]["client-resources"].items()}
    if args.num_cpus is not None:
        resources["num_cpus"] = args.num_cpus
    if args.num_gpus is not None:
        resources["num_gpus"] = args.num_gpus
    with tempfile.TemporaryDirectory(prefix="fedskew-flower-sim-") as home:
        t0 = time.perf_counter()
        with LocalSimulation(Path(home), clients, **resources) as sim:
            argv = ["--run-config", args.run_config] if args.run_config else []
            out, _ = sim.run_app(app_dir, timeout=args.timeout, extra_args=argv)
            print(out)
            print(f"flwr run on {clients} simulated SuperNodes took {time.perf_counter() - t0:.1f} s")
        left = sim.leftovers()
    if left:
        print(f"warning: processes left behind: {left}", file=sys.stderr)
        return 1
    return 0


def valid_compositions() -> list[str]:
    """Every valid composition, canonical names, as ``fedskew methods`` lists them (each client part alone and with
    each plug-in, and each pair of plug-ins: fedskew/method_index.py)."""
    from fedskew.method_index import method_index

    return list(method_index()["valid"])


CHECK_DEFAULTS = {"clients": 4, "rounds": 3, "join_ratio": 0.75, "client_dropout": 0.2, "skew_probes": 0}


def cmd_check(args: argparse.Namespace) -> int:
    import tempfile

    from fedskew.flower import require_flwr

    require_flwr()
    from fedskew.flower.inprocess import compare_with_simulator

    for key, value in CHECK_DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    methods = args.methods or valid_compositions()
    failed = []
    for name in methods:
        args.method = name
        cfg = _config(args)
        with tempfile.TemporaryDirectory(prefix="fedskew-check-") as tmp:
            try:
                worst, diffs = compare_with_simulator(cfg, Path(tmp))
            except Exception as exc:  # one broken composition must not hide the others
                worst, diffs = float("nan"), [f"{type(exc).__name__}: {exc}"]
        status = "same" if not diffs else "DIFFERENT"
        print(f"{status:<9} {name:<28} max |flower - simulator| = {worst:.1e}", flush=True)
        for d in diffs[:5]:
            print(f"          {d}")
        if diffs:
            failed.append(name)
    print(f"{len(methods) - len(failed)} of {len(methods)} compositions give the simulator's metrics on Flower")
    return 1 if failed else 0


def cmd_flower(args: argparse.Namespace) -> int:
    from fedskew.flower import FlowerMissingError

    handlers = {"new": cmd_new, "local": cmd_local, "check": cmd_check, "loopback": cmd_loopback}
    handler = {**handlers, "simulate": cmd_simulate}[args.flower_command]
    try:
        return handler(args)
    except FlowerMissingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


HANDLERS = {"flower": cmd_flower}
