"""The run settings' command-line flags, shared by ``fedskew run`` and the subcommands that configure a run
(``partition``, ``tune``, ``flower``), and the run configuration they make (:func:`config_from_args`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml

# `fedskew run` switches (store_true flags) that set a config key of the same name to true
RUN_SWITCHES = (
    "batched_clients",
    "capture_steps",
    "cudnn_benchmark",
    "channels_last",
    "validation_select",
    "drop_last",
)

# the run settings `fedskew run` takes as flags, in --help's order; each flag is the setting's name with dashes
# (--local-epochs sets local_epochs), its type and help come from the setting's one declaration in RunConfig
FLAG_KEYS = (
    "method",
    "dataset",
    "data_dir",
    "partition",
    "protocol",
    "alpha",
    "classes_per_client",
    "uniform_clients",
    "pat_scheme",
    "min_size",
    "imbalance_ratio",
    "feature_noise",
    "noise_draw",
    "samples_per_client",
    "test_samples_per_client",
    "clients",
    "join_ratio",
    "rounds",
    "local_epochs",
    "batch_size",
    "lr",
    "momentum",
    "weight_decay",
    "model",
    "train_ratio",
    "validation",
    "evaluate_on",
    "eval_every",
    "eval_clients",
    "heldout_clients",
    "last_n",
    "skew_probes",
    "domain_fraction",
    "image_size",
    "resize",
    "on_bad_update",
    "client_dropout",
    "client_sampling",
    "dp_clip",
    "dp_noise",
    "dp_epsilon",
    "dp_delta",
    "dp_accountant",
    "dp_weight_cap",
    "dp_clip_quantile",
    "dp_clip_lr",
    "dp_count_noise",
    "dp_report_noise",
    "dp_extras_scale",
    "aggregation",
    "stacked_conv",
    "tf32",
    "precision",
    "checkpoint_every",
    "seed",
    "data_seed",
    "partition_rng",
    "device",
    "threads",
    "workers",
    "state_store",
    "state_memory",
    "out",
    "db",
    "log",
    "log_uri",
)


def flag_type(annotation: Any) -> Callable[[str], Any]:
    """The command-line parser of a setting's type: ``int`` / ``float`` for numbers (``X | None`` too), a word or a
    number for ``Literal["auto"] | int``, else the string as given (the configuration validates it)."""
    args = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    args = tuple(a for a in args if a is not type(None))
    words = [v for a in args if get_origin(a) is Literal for v in get_args(a)]
    plain = [a for a in args if get_origin(a) is not Literal]
    if plain == [int] and words:
        return lambda v: v if v in words else int(v)
    if len(plain) == 1 and plain[0] in (int, float) and not words:
        return plain[0]  # type: ignore[no-any-return]
    return str


def flag_help(info: Any) -> str:
    """A setting's description (with its choices when it has a fixed set), escaped for argparse."""
    text = info.description or ""
    choices = [
        v for a in (info.annotation, *get_args(info.annotation)) if get_origin(a) is Literal for v in get_args(a)
    ]
    if choices and not all(str(c) in text for c in choices):
        text = f"{' | '.join(map(str, choices))}: {text}" if text else " | ".join(map(str, choices))
    return text.replace("%", "%%")


def _run_flags() -> dict[str, tuple[str, Callable[[str], Any], str]]:
    from fedskew.config import RunConfig

    fields = RunConfig.model_fields
    return {f"--{k.replace('_', '-')}": (k, flag_type(fields[k].annotation), flag_help(fields[k])) for k in FLAG_KEYS}


# flag name -> (config key, parser, help); every one of these overrides the YAML file
RUN_FLAGS: dict[str, tuple[str, Callable[[str], Any], str]] = _run_flags()


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


def add_dataset_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset-arg",
        "-D",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the dataset's reader, repeatable (e.g. -D label=character for --dataset hf)",
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
    if getattr(args, "dataset_arg", None):
        overrides["dataset_args"] = parse_kv(args.dataset_arg, "-D/--dataset-arg")
    if args.no_db:
        file_values["db"] = None
        overrides.pop("db", None)
    return make_config(file_values, overrides)
