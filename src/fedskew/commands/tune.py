"""``fedskew tune``: each method's hyper-parameters searched on the clients' validation splits (Optuna), written as
``tuned.yaml`` for ``fedskew sweep --tuned`` and ``fedskew reproduce --tuned`` (:mod:`fedskew.tuning.study`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

# `fedskew run` flags a search sets itself (per trial) or names differently
_OWNED_FLAGS = ("--method", "--seed", "--out", "--db", "--validation", "--evaluate-on")


def add_parsers(sub: Any) -> None:
    from fedskew.commands.flags import RUN_FLAGS, add_download_flag

    tp = sub.add_parser(
        "tune",
        help="search each method's hyper-parameters on validation data (Optuna; extra fedskew[tune]) -> tuned.yaml",
        description="Tunes each method's declared hyper-parameters (the ranges its paper states; `--space` "
        "overrides) with Optuna's TPE on a validation split carved from every client's training data: no test "
        "sample is read. Hopeless trials are pruned on the per-round validation curve. The studies live in an "
        "SQLite file (or --storage URL), so the same command continues an interrupted search and several "
        "processes or machines can tune together. Writes OUT/tuned.yaml (best arguments per method and setting), "
        "the trials into the results database and OUT/figures/search-*.png.",
    )
    tp.add_argument("spec", nargs="?", default=None, help="a tune spec (YAML: base, methods, space, trials, ...)")
    tp.add_argument("--methods", default=None, help="methods to tune, comma-separated (e.g. fedprox,qffl,fedavg+afl)")
    tp.add_argument("--config", default=None, help="YAML file of the base settings; flags override it")
    for flag, (_, typ, help_) in RUN_FLAGS.items():
        if flag not in _OWNED_FLAGS:
            tp.add_argument(flag, type=typ, default=None, help=help_)
    add_download_flag(tp)
    tp.add_argument(
        "--method-arg", "-m", action="append", default=[], metavar="KEY=VALUE", help="fixed method argument (all)"
    )
    tp.add_argument("--trials", type=int, default=None, help="trials per method (default 20)")
    tp.add_argument("--seeds", default=None, help="seeds each trial runs, comma-separated (default 0)")
    tp.add_argument(
        "--validation", type=float, default=None, help="share of every client's training split held out (default 0.2)"
    )
    tp.add_argument("--metric", default=None, help="objective metric (default: the protocol's headline)")
    tp.add_argument("--statistic", choices=("last_n_mean", "best", "final"), default=None, help="of the curve")
    tp.add_argument(
        "--space",
        action="append",
        default=[],
        metavar="KEY=SPEC",
        help="search-space override: log:1e-4..1, 0.1..0.9, int:1..10, [a,b], none (repeatable; lr=... adds lr)",
    )
    tp.add_argument("--no-prune", action="store_true", help="never prune a trial")
    tp.add_argument("--warmup-rounds", type=int, default=None, help="rounds before pruning may act (default R/4)")
    tp.add_argument("--storage", default=None, help="Optuna storage URL (default sqlite:///OUT/optuna.db)")
    tp.add_argument("--out", default=None, help="output folder (default runs/tune-NAME)")
    tp.add_argument("--db", default=None, help="results database for the trials (default OUT/fedskew.db)")
    tp.add_argument("--tuned", default=None, help="tuned.yaml to write or update (default OUT/tuned.yaml)")
    tp.add_argument("--name", default=None, help="the search's name (default: the spec's file name, or 'tune')")
    tp.add_argument("--jobs", "-j", type=int, default=None, help="trials at a time, each in its own process")
    tp.add_argument("--timeout", type=float, default=None, help="seconds per method after which no trial starts")
    tp.add_argument("--quiet", action="store_true", help="no line per trial")
    tp.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="local: --jobs processes on this machine; ray: the --jobs workers of each study as Ray tasks (one CPU "
        "each) on a Ray cluster (--address) or a local Ray instance; across machines the study needs a database server "
        "(--storage) and --out on a shared file system (extra [ray]; docs/tuning.md)",
    )
    tp.add_argument("--address", default=None, help="--executor ray: the cluster (HOST:PORT, auto)")


def _updates(args: argparse.Namespace) -> dict[str, Any]:
    """The tune spec's values given on the command line."""
    from fedskew.commands.flags import RUN_FLAGS, parse_kv
    from fedskew.config import ConfigError, load_yaml

    base: dict[str, Any] = load_yaml(args.config) if args.config else {}
    for flag, (key, _, _) in RUN_FLAGS.items():
        if flag in _OWNED_FLAGS:
            continue
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            base[key] = value
    if args.download:
        base["download"] = True
    if args.method_arg:
        base["method_args"] = {**base.get("method_args", {}), **parse_kv(args.method_arg)}
    space: dict[str, Any] = {}
    for item in args.space:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--space expects KEY=SPEC, got {item!r}")
        space[key.strip().replace("-", "_")] = value.strip()
    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    except ValueError:
        raise ConfigError(f"--seeds expects comma-separated integers, got {args.seeds!r}") from None
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    return {
        "base": base or None,
        "methods": methods,
        "space": space or None,
        "trials": args.trials,
        "seeds": seeds,
        "validation": args.validation,
        "metric": args.metric,
        "statistic": args.statistic,
        "prune": False if args.no_prune else None,
        "warmup_rounds": args.warmup_rounds,
        "storage": args.storage,
        "out": args.out,
        "db": args.db,
        "tuned": args.tuned,
        "name": args.name,
        "jobs": args.jobs,
        "timeout": args.timeout,
    }


def shown_value(value: float, metric: str) -> str:
    """A trial's value as ``run`` and ``report`` show the metric: accuracies (``*_acc*``, the domain AVG and STD) in
    percent, anything else (a loss) as it is."""
    return f"{100 * value:.2f}%" if "acc" in metric or metric in ("auto", "headline") else f"{value:.4f}"


def cmd_tune(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from fedskew.commands import console as make_console
    from fedskew.config import ConfigError

    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ConfigError("fedskew tune needs Optuna: pip install 'fedskew[tune]' (or pip install optuna)") from None
    from fedskew.tuning.study import load_tune_spec, searched_spaces, trial_row, tune
    from fedskew.tuning.tuned import format_args

    updates = _updates(args)
    if not args.spec and not updates["methods"]:
        raise ConfigError("name the methods to tune: --methods fedprox,qffl (or a tune spec with methods:)")
    spec = load_tune_spec(args.spec, updates)
    console = make_console(stderr=True, soft_wrap=True)
    console.print(
        f"tune {spec.name}: {len(spec.methods)} method(s), {spec.trials} trials each, seeds {spec.seed_list()}, "
        f"validation {spec.validation:g} of each client's training split; storage {spec.storage_url}",
        highlight=False,
    )
    for entry, space in searched_spaces(spec):
        shown = ", ".join(f"{k} {d.describe()}" for k, d in space.items()) or "nothing to search: one run (reference)"
        console.print(escape(f"  {entry.display()}: {shown}"), highlight=False)

    def on_trial(entry: Any, study: Any, trial: Any) -> None:
        if args.quiet:
            return
        row = trial_row(spec, entry, study, trial)
        params = format_args(row["params"])
        value = shown_value(row["value"], spec.metric) if row["value"] is not None else row["state"]
        if row["state"] == "pruned" and row["last_value"] is not None:
            value = f"pruned at step {row['last_step']} ({shown_value(row['last_value'], spec.metric)})"
        line = f"  {study.study_name} #{row['number']} {params or '(defaults)'}: {value}"
        console.print(escape(line), highlight=False)

    from fedskew.commands.sweep import make_executor
    from fedskew.runner import RunInterrupted

    args.gpus_per_run = None  # a tune worker takes one CPU (a cuda device is the base's `device`)
    executor = make_executor(args, spec.jobs, None)
    if executor is not None:
        where = executor.where()
        shared = "a database server URL (--storage postgresql://...) and --out on a file system every node shares"
        console.print(
            f"the {spec.jobs} worker(s) of each study run as Ray tasks on {where}; across machines they need {shared}",
            highlight=False,
        )
    try:
        results = tune(
            spec,
            on_trial=on_trial,
            on_note=lambda m: console.print(f"note: {m}", highlight=False),
            executor=executor,
        )
    except (RunInterrupted, KeyboardInterrupt):
        console.print("interrupted: finished trials are kept; the same command continues the search", highlight=False)
        return 130
    table = Table(title=f"fedskew tune {spec.name}: best on the validation splits")
    for col in ("method", "metric", "best", "arguments", "trials (complete/pruned/failed)"):
        table.add_column(col)
    for r in results:
        best = r.best
        args_text = format_args({**best.args, **best.run}) if best else ""
        table.add_row(
            escape(r.entry.display()),
            r.metric,
            shown_value(best.extra["value"], r.metric) if best else "-",
            escape(args_text or ("(defaults)" if best else "no complete trial")),
            f"{r.counts['complete']}/{r.counts['pruned']}/{r.counts['fail']}",
        )
    out = make_console()
    if not out.is_terminal:  # a log file: no wrapping at 80 columns
        out = make_console(width=200)
    out.print(table)
    for line in evaluation_lines(results, spec.statistic):
        print(line)
    print(f"tuned: {spec.tuned_path}   trials: {spec.db_path} (table trials)   figures: {spec.root / 'figures'}/")
    missing = [r.entry.display() for r in results if r.best is None]
    if missing:
        print(f"no complete trial for: {', '.join(missing)} (see the trials above)", file=sys.stderr)
        return 1
    return 0


def evaluation_lines(results: list, statistic: str) -> list[str]:
    """The tuning table's evaluation protocol: each objective's view on the validation splits, the statistic, the mean
    over seeds (:mod:`fedskew.results.evaluation`)."""
    from fedskew.results.evaluation import describe

    out = []
    for metric in dict.fromkeys(r.metric for r in results):
        try:
            ev = describe(metric, statistic, evaluate_on="validation")
        except ValueError:
            out.append(f"evaluation protocol: {metric}, {statistic} on the validation splits, mean over seeds")
            continue
        out.append(
            f"evaluation protocol: {metric}, {ev.round}: {ev.model} on {ev.data}, {ev.mean}; the mean over the "
            "study's seeds (the test data is never read)"
        )
    return out


HANDLERS = {"tune": cmd_tune}
