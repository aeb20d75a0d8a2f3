"""``fedskew partition``: a partition's per-client label table and bubble plot, and ``--list``: the schemes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fedskew.commands.flags import RUN_FLAGS, add_dataset_arg, add_download_flag, add_partition_arg, parse_kv

# the figure files matplotlib writes (checked before the partition is built; a .txt was a traceback after it)
FIGURE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp")

RESERVED_SUMMARIES = {
    "domain": "domain skew: clients of a multi-domain suite, each from one domain",
    "given": "the clients of per-client data files, as given",
    "natural": "the data's own clients (writers, speakers, users): --clients N samples N of them, seeded",
}


def add_parsers(sub: Any) -> None:
    pa = sub.add_parser("partition", help="show a partition: per-client label table and a bubble plot")
    pa.add_argument("--config", help="YAML file of settings; flags override it")
    for flag in (
        "--dataset",
        "--data-dir",
        "--partition",
        "--protocol",
        "--alpha",
        "--classes-per-client",
        "--uniform-clients",
        "--pat-scheme",
        "--min-size",
        "--samples-per-client",
        "--test-samples-per-client",
        "--imbalance-ratio",
        "--clients",
        "--train-ratio",
        "--domain-fraction",
        "--image-size",
        "--resize",
        "--seed",
        "--data-seed",
        "--partition-rng",
    ):
        _, typ, help_ = RUN_FLAGS[flag]
        pa.add_argument(flag, type=typ, default=None, help=help_)
    add_download_flag(pa)
    add_partition_arg(pa)
    add_dataset_arg(pa)
    pa.add_argument("--plot", default=None, help="write the bubble plot to this PNG")
    pa.add_argument("--list", action="store_true", help="list the partition schemes (registered ones included)")


def cmd_partition(args: argparse.Namespace) -> int:
    from fedskew.config import load_yaml, make_config
    from fedskew.data.federated import build_federated
    from fedskew.results.partition_view import bubble_plot, label_table

    if args.list:
        from fedskew.data.partition.registry import BUILTIN, PARTITIONS, RESERVED, SUMMARIES, load_entry_points

        load_entry_points()
        for name in [*PARTITIONS, *RESERVED]:
            kind = "built-in" if name in BUILTIN or name in RESERVED else "registered"
            print(f"{name:<10} {kind:<10} {SUMMARIES.get(name, RESERVED_SUMMARIES.get(name, ''))}")
        return 0
    if args.plot and Path(args.plot).suffix.lower().lstrip(".") not in FIGURE_FORMATS:
        print(
            f"error: --plot {args.plot}: a figure file ends in one of .{', .'.join(FIGURE_FORMATS)}", file=sys.stderr
        )
        return 2
    file_values = load_yaml(args.config) if args.config else {}
    overrides = {key: getattr(args, flag[2:].replace("-", "_"), None) for flag, (key, _, _) in RUN_FLAGS.items()}
    overrides["download"] = args.download
    if args.partition_arg:
        overrides["partition_args"] = parse_kv(args.partition_arg, "-P/--partition-arg")
    if args.dataset_arg:
        overrides["dataset_args"] = parse_kv(args.dataset_arg, "-D/--dataset-arg")
    cfg = make_config({**file_values, "db": None}, overrides)
    data = build_federated(cfg)
    seed = f"seed {cfg.seed}" if cfg.data_seed is None else f"data seed {cfg.data_seed}"
    seed += " (raw generator)" if cfg.partition_rng == "raw" else ""
    print(f"{cfg.dataset}, partition {cfg.partition}, {seed} (global test set: {len(data.y_test)} samples)")
    print(label_table(data.train_hists, data.test_hists))
    if args.plot:
        title = f"{cfg.dataset}: {cfg.partition}, {cfg.clients} clients, {seed} (train + test samples)"
        print(f"bubble plot: {bubble_plot(data.train_hists + data.test_hists, args.plot, title)}")
    return 0


HANDLERS = {"partition": cmd_partition}
