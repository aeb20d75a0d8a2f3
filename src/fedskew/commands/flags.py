"""The run settings' command-line flags, shared by ``fedskew run`` and the subcommands that configure a run
(``partition``, ``tune``, ``flower``), and the run configuration they make (:func:`config_from_args`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import yaml

# `fedskew run` switches (store_true flags) that set a config key of the same name to true
RUN_SWITCHES = ("batched_clients", "channels_last")

# flag name -> config key; every one of these overrides the YAML file
RUN_FLAGS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "--method": ("method", str, "method or composition (see `fedskew methods`)"),
    "--dataset": ("dataset", str, "digits (embedded), mnist, ..., folder or npz (your data, with --data-dir)"),
    "--data-dir": ("data_dir", str, "directory with the dataset files (default: $FEDSKEW_DATA)"),
    "--partition": (
        "partition",
        str,
        "iid | dir | pat | dirfixed | niid2 | biased | quantity | domain | given, or a registered scheme "
        "(`fedskew partition --list`; its parameters with -P KEY=VALUE)",
    ),
    "--protocol": (
        "protocol",
        str,
        "fedskew | pfllib (PFLlib's split and evaluation semantics) | fedcac (FedCAC's fixed-size train/test draws)",
    ),
    "--alpha": ("alpha", float, "Dirichlet concentration"),
    "--classes-per-client": ("classes_per_client", int, "classes per client for pat, per biased client for biased"),
    "--uniform-clients": ("uniform_clients", int, "biased: clients holding every class (the others are biased)"),
    "--pat-scheme": ("pat_scheme", str, "pat: random | pfllib (blocked)"),
    "--min-size": ("min_size", int, "minimum samples per client for dir"),
    "--imbalance-ratio": ("imbalance_ratio", float, "global long-tail imbalance of the training pool"),
    "--samples-per-client": ("samples_per_client", int, "samples per client for dirfixed"),
    "--test-samples-per-client": ("test_samples_per_client", int, "local test samples per client (fedcac)"),
    "--clients": ("clients", int, "number of clients"),
    "--join-ratio": ("join_ratio", float, "share of clients sampled per round"),
    "--rounds": ("rounds", int, "communication rounds"),
    "--local-epochs": ("local_epochs", int, "local epochs per round"),
    "--batch-size": ("batch_size", int, "local batch size"),
    "--lr": ("lr", float, "local SGD learning rate"),
    "--momentum": ("momentum", float, "local SGD momentum"),
    "--weight-decay": ("weight_decay", float, "local SGD weight decay"),
    "--model": ("model", str, "mlp | cnn | lenet | resnet8/10/18/34 | textcnn | auto"),
    "--train-ratio": ("train_ratio", float, "per-client train share (rest = local test)"),
    "--validation": ("validation", float, "share of every client's training split held out as validation (0: none)"),
    "--evaluate-on": ("evaluate_on", str, "test | validation: what every evaluation view scores"),
    "--eval-every": ("eval_every", int, "evaluate every N rounds"),
    "--eval-clients": (
        "eval_clients",
        int,
        "score per-client models on a seeded sample of N clients per evaluated round (all at the last round)",
    ),
    "--last-n": ("last_n", int, "summaries average the last N evaluated rounds"),
    "--skew-probes": ("skew_probes", int, "positions per layer recorded for `fedskew skew` (0: off)"),
    "--domain-fraction": ("domain_fraction", float, "share of its domain's training set per client (domain)"),
    "--image-size": ("image_size", int, "common image side of the domains (domain suites)"),
    "--resize": ("resize", int, "dataset folder: resize every image to N x N (needed when image sizes differ)"),
    "--on-bad-update": ("on_bad_update", str, "fail | drop: what a non-finite, mis-shaped or wrong-dtype upload does"),
    "--client-dropout": ("client_dropout", float, "probability that a sampled client fails to report (seeded)"),
    "--checkpoint-every": (
        "checkpoint_every",
        lambda v: v if v == "auto" else int(v),
        "write a resumable checkpoint every K rounds (0: never; default auto: < 2%% of the run time)",
    ),
    "--seed": ("seed", int, "the one seed of the run"),
    "--device": ("device", str, "cpu, cuda, cuda:1, ..."),
    "--threads": ("threads", int, "torch CPU threads (default 1; 0 = torch's default)"),
    "--workers": ("workers", int, "processes training clients in parallel (default 1; results identical)"),
    "--state-store": ("state_store", str, "auto | memory | disk: where per-client state lives (results identical)"),
    "--state-memory": ("state_memory", str, "RAM budget for per-client state, e.g. 2GB (default: 25%% of RAM)"),
    "--out": ("out", str, "run directory (default runs/<stamp>-<method>-<dataset>-...)"),
    "--db": ("db", str, "SQLite results database (default runs/fedskew.db)"),
    "--log": ("log", str, "live loggers, comma-separated: tensorboard, mlflow, wandb (docs/loggers.md)"),
    "--log-uri": ("log_uri", str, "MLflow tracking URI (default $MLFLOW_TRACKING_URI, else a file store runs/mlruns)"),
}


def parse_kv(items: list[str], flag: str = "-m/--method-arg") -> dict[str, Any]:
    """``KEY=VALUE`` items (the value read as YAML: ``0.1``, ``true``, ``[1, 2]``) as a mapping."""
    from fedskew.config import ConfigError

    out: dict[str, Any] = {}
    short = flag.split("/")[0]
    for item in items:
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise ConfigError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            out[k.strip().replace("-", "_")] = yaml.safe_load(v)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{short} {item!r}: the value is not valid YAML ({exc})") from None
    return out


def add_partition_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--partition-arg",
        "-P",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a registered partition scheme's parameter, repeatable (e.g. -P per_client=2)",
    )


def add_download_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--download",
        action="store_true",
        default=None,
        help="fetch missing official dataset files into --data-dir (MD5-checked; needs the network)",
    )


def config_from_args(args: argparse.Namespace):
    """The run configuration from ``--config``, the ``RUN_FLAGS`` and ``-m`` (``fedskew run``, ``fedskew flower``)."""
    from fedskew.config import ConfigError, load_yaml, make_config

    if getattr(args, "resume", None):
        from fedskew.runner import resume_config

        flags = {key: getattr(args, flag[2:].replace("-", "_")) for flag, (key, _, _) in RUN_FLAGS.items()}
        if args.no_db:
            flags["db"] = None
        for switch in RUN_SWITCHES:
            if getattr(args, switch, False):
                flags[switch] = True
        if args.config or args.method_arg:
            raise ConfigError("--resume takes the run's own config.yaml; drop --config and -m")
        if flags.get("out") not in (None, args.resume):
            raise ConfigError("--resume RUN_DIR continues in RUN_DIR; drop --out")
        return resume_config(args.resume, {k: v for k, v in flags.items() if k != "out"})

    file_values = load_yaml(args.config) if args.config else {}
    overrides: dict[str, Any] = {
        key: getattr(args, flag[2:].replace("-", "_")) for flag, (key, _, _) in RUN_FLAGS.items()
    }
    overrides["download"] = getattr(args, "download", None)  # flags a subcommand lacks are simply not set
    for switch in RUN_SWITCHES:  # flags a subcommand lacks are simply not set
        if getattr(args, switch, False):
            overrides[switch] = True
    if args.method_arg:
        overrides["method_args"] = parse_kv(args.method_arg)
    if getattr(args, "partition_arg", None):
        overrides["partition_args"] = parse_kv(args.partition_arg, "-P/--partition-arg")
    if args.no_db:
        file_values["db"] = None
        overrides.pop("db", None)
    return make_config(file_values, overrides)
