"""``fedskew`` command line: run | methods | report. Thin: parse, validate, call, print."""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

from fedskew import __version__
from fedskew.commands.flags import (
    RUN_FLAGS,
    add_dataset_arg,
    add_download_flag,
    add_partition_arg,
    config_from_args,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedskew", description="Federated learning under data heterogeneity.")
    p.add_argument("--version", action="version", version=f"fedskew {__version__}")
    sub = p.add_subparsers(dest="command")

    run = sub.add_parser("run", help="run one simulated federation (no arguments: the digits main job)")
    run.add_argument("--config", help="YAML file of settings; flags override it")
    for flag, (_, typ, help_) in RUN_FLAGS.items():
        run.add_argument(flag, type=typ, default=None, help=help_)
    run.add_argument(
        "--method-arg",
        "-m",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="method hyper-parameter, repeatable (e.g. -m weights=uniform)",
    )
    add_partition_arg(run)
    add_dataset_arg(run)
    add_download_flag(run)
    run.add_argument("--no-db", action="store_true", help="do not record the run in the SQLite database")
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing fedskew run directory (only fedskew's own files in it are deleted)",
    )
    run.add_argument(
        "--batched-clients",
        action="store_true",
        help="train the sampled clients together (vmapped; for a GPU; equal up to float rounding, docs/design.md)",
    )
    run.add_argument(
        "--capture-steps",
        action="store_true",
        help="with --batched-clients: each step at one of a few padded shapes, replayed as a CUDA graph on a GPU "
        "(engine/captured.py; equal up to float rounding)",
    )
    run.add_argument(
        "--channels-last",
        action="store_true",
        help="channels-last memory order for convolutions (faster on CPU; equal up to float rounding)",
    )
    run.add_argument(
        "--validation-select",
        action="store_true",
        help="score the validation splits (--validation S) every evaluated round and record each metric's "
        "validation-selected round (chosen on them, reported on the test data; docs/protocols.md)",
    )
    run.add_argument(
        "--drop-last",
        action="store_true",
        help="drop each epoch's last partial batch in local training (PFLlib's loaders do; default: kept)",
    )
    run.add_argument("--resume", metavar="RUN_DIR", default=None, help="continue an unfinished run from its checkpoint")
    run.add_argument("--quiet", action="store_true", help="no progress bar")

    me = sub.add_parser("methods", help="list the available methods and building blocks")
    me.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="a method, plug-in or composition (fedprox+disco): its paper, summary, hyper-parameters with their "
        "defaults and tunable ranges, and whether it can run under DP",
    )
    me.add_argument(
        "--compositions",
        action="store_true",
        help="also list every valid two-part composition and every refused one with its reason (long)",
    )

    sk = sub.add_parser("skew", help="plot parameter skew of a run: client values vs aggregates, H/M over rounds")
    sk.add_argument("run_dir", help="a run directory (with skew.jsonl)")
    sk.add_argument("--layer", action="append", default=None, help="parameter name, repeatable (default: first 4)")
    sk.add_argument("--round", type=int, default=None, help="probed round to show (default: last)")
    sk.add_argument("--positions", type=int, default=2, help="positions shown per layer")
    sk.add_argument("--out", default=None, help="PNG path (default RUN_DIR/skew.png)")

    db = sub.add_parser("db", help="results database maintenance")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    imp = db_sub.add_parser("import", help="record ended run directories in the database (idempotent)")
    imp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    imp.add_argument("--db", default="runs/fedskew.db")

    rep = sub.add_parser(
        "report",
        help="table of experiments (whole config but the seed), mean ± std over distinct seeds",
        description="One row per experiment (the whole resolved configuration except the seed); the settings that "
        "differ between rows are columns, the shared ones are listed once. Each seed counts once (its latest run). "
        "Every row is compared paired (seed by seed) with its reference row of the same setting: the mean "
        "difference with its 95%% interval (paired t; bootstrap from 10 common seeds), * when it excludes 0, and "
        "the smallest difference the seeds could detect under each column.",
    )
    rep.add_argument("--db", default="runs/fedskew.db", help="SQLite results database (default runs/fedskew.db)")
    rep.add_argument(
        "--metric",
        action="append",
        default=None,
        help="metric(s), repeatable or comma-separated (default global_acc): global_local_acc, personal_acc, "
        "domain_acc_avg, domain_acc/<name>, ...",
    )
    rep.add_argument("--format", choices=("markdown", "csv", "latex"), default="markdown", help="default markdown")
    rep.add_argument(
        "--last-n",
        type=int,
        default=None,
        metavar="N",
        help="recompute the last-N mean from the stored round records (default: each run's summary, its --last-n)",
    )
    rep.add_argument(
        "--plot",
        metavar="DIR",
        default=None,
        help="also write figures to DIR: accuracy vs round per setting (mean ± std over seeds, one curve per row), "
        "the paired difference of each row against its reference with its 95%% interval, and, for domain skew, "
        "a per-domain table (methods x domains, AVG, STD); each PNG with a JSON of its numbers",
    )
    rep.add_argument(
        "--against",
        metavar="ROW",
        default=None,
        help="the reference row of the paired differences: a row's method as shown in the table (e.g. "
        "'fedavg (weights=uniform)') or a method (e.g. fedprox); default: FedAvg with its default arguments, and "
        "the host for a host+plug-in row (fedprox+heal against fedprox), within each setting",
    )
    rep.add_argument(
        "--seeds-needed",
        type=float,
        default=None,
        metavar="D",
        help="add, per row, how many seeds a paired t-test (two-sided, alpha 0.05, power 0.8; exact, noncentral t) "
        "would need to resolve a difference of D points against its reference, from the paired std of its runs",
    )
    for module in _command_modules():
        module.add_parsers(sub)
    return p


# subcommands defined next to what they drive: each module has add_parsers(sub) and HANDLERS (name -> handler)
COMMAND_MODULES = (
    "fedskew.commands.partition",
    "fedskew.commands.sweep",
    "fedskew.commands.tune",
    "fedskew.commands.flower",
)


def _command_modules() -> list[Any]:
    import importlib
    import importlib.util

    return [importlib.import_module(m) for m in COMMAND_MODULES if importlib.util.find_spec(m) is not None]


def cmd_run(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fedskew.commands import console as make_console
    from fedskew.results.rundir import stale_runs
    from fedskew.runner import RunInterrupted, run_experiment

    console = make_console(stderr=True, soft_wrap=True)
    cfg = config_from_args(args)
    out_root = Path(cfg.out).parent if cfg.out else Path("runs")
    for stale in stale_runs(out_root):
        if not cfg.out or Path(cfg.out).resolve() != stale.resolve():
            console.print(
                f"note: {stale} holds a run that was killed; resume it with `fedskew run --resume {stale}`",
                highlight=False,
            )
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[acc]}"),
        TimeElapsedColumn(),
        console=console,
        disable=args.quiet,
    )
    with progress:
        task = progress.add_task(f"{cfg.method} on {cfg.dataset}", total=cfg.rounds, acc="")

        def on_round(result) -> None:
            rec = result.record
            acc = f"acc {100 * rec['global_acc']:.2f}%" if "global_acc" in rec else ""
            progress.update(task, advance=1, acc=acc)

        try:
            outcome = run_experiment(
                cfg,
                overwrite=args.overwrite,
                resume=bool(args.resume),
                on_round=on_round,
                on_start=lambda sim, first: progress.update(task, completed=first - 1),
                on_note=lambda msg: console.print(f"note: {msg}", highlight=False),
            )
        except RunInterrupted as exc:
            progress.stop()
            console.print(
                f"[bold yellow]{exc}[/]; checkpoint written. Resume with: fedskew run --resume {exc.run_dir}",
                highlight=False,
            )
            return 128 + exc.signum
    print_summary(outcome.summary, outcome.run_dir, cfg)
    if outcome.summary["diverged"]:
        done = outcome.summary["rounds"]
        console.print(
            f"[bold red]error: training diverged in round {outcome.summary['diverged_round']}: "
            f"{outcome.summary['diverged_reason']}.[/] The run stopped; its {done} finished round(s) are in "
            f"{outcome.run_dir}/ with `diverged: true` in summary.json"
            + (" and the database" if cfg.db else "")
            + ". Try a smaller --lr, or gradient-stable settings for this method.",
            highlight=False,
        )
        return 3
    return 0


def print_summary(summary: dict[str, Any], run_dir: Path, cfg) -> None:
    from rich.markup import escape
    from rich.table import Table

    from fedskew.commands import console as make_console

    args = ", ".join(f"{k}={v}" for k, v in sorted(cfg.method_args.items()))  # fedavg (weights=uniform)
    method = escape(f"{cfg.method} ({args})" if args else cfg.method)  # a list value is not rich markup
    table = Table(
        title=f"fedskew {method} on {cfg.dataset} ({cfg.partition}, {cfg.clients} clients, "
        f"{cfg.rounds} rounds, seed {cfg.seed})"
        + ("; every view scored on the clients' validation splits" if cfg.evaluate_on == "validation" else "")
    )
    table.add_column("metric")
    table.add_column("final", justify="right")
    table.add_column("best (round)", justify="right")
    # the mean covers at most the evaluated rounds (a 3-round run averages 3, not the configured 10)
    n = min(summary["last_n"], summary.get("evaluated_rounds", summary["last_n"]))
    table.add_column(f"last {n} mean ± std", justify="right")
    selected = any(isinstance(v, dict) and "validation_selected" in v for v in summary.values())
    if selected:  # validation splits: the round chosen on them, reported on the test data
        table.add_column("val-selected (round)", justify="right")
    labels = {
        "global_acc": "global model, global test",
        "global_local_acc": "global model, clients' tests (weighted)",
        "global_local_acc_mean": "global model, clients' tests (mean)",
        "global_local_acc_worst10": "global model, worst-10% clients",
        "personal_acc": "personal, after aggregation (weighted)",
        "personal_acc_mean": "personal, after aggregation (mean)",
        "personal_acc_worst10": "personal, after aggregation, worst-10%",
        "trained_acc": "personal, after training (weighted)",
        "trained_acc_mean": "personal, after training (mean)",
        "trained_acc_worst10": "personal, after training, worst-10%",
        "heldout_acc": "held-out clients, global model (weighted)",
        "heldout_acc_mean": "held-out clients, global model (mean)",
        "heldout_adapted_acc": "held-out clients, adapted (weighted)",
        "heldout_adapted_acc_mean": "held-out clients, adapted (mean)",
        "val_global_acc": "global model, clients' validation splits",
        "val_personal_acc": "personal, clients' validation splits",
    }
    # domain skew: one row per domain (``domain_acc/<name>``), then AVG and STD across them
    labels.update({k: f"global model, domain {k.split('/', 1)[1]}" for k in summary if k.startswith("domain_acc/")})
    labels["domain_acc_avg"] = "global model, mean over domains (AVG)"
    labels["domain_acc_std"] = "std across domains (STD, lower is better)"
    for key, label in labels.items():
        if key not in summary:
            continue
        s = summary[key]
        cells = [
            label,
            f"{100 * s['final']:.2f}%",
            f"{100 * s['best']:.2f}% ({s['best_round']})",
            f"{100 * s['last_n_mean']:.2f} ± {100 * s['last_n_std']:.2f}%",
        ]
        if selected:
            v = s.get("validation_selected")
            cells.append("-" if v is None else f"{100 * v:.2f}% ({s['validation_round']})")
        table.add_row(*cells)
    console = make_console()
    if summary["rounds"]:
        console.print(table)
        head, ev = summary.get("headline") or {}, summary.get("evaluation") or {}
        if head and ev:
            console.print(
                f"headline ({head.get('protocol', cfg.protocol)} protocol): {100 * head['value']:.2f}% = "
                f"{ev['metric']}, {ev['round']}; {ev['model']} on {ev['data']}, {ev['mean']}; clients: {ev['clients']}",
                highlight=False,
            )
        console.print(
            f"wall time {summary['wall_time']:.1f}s; per round: train {summary['mean_time_train']:.3f}s, "
            f"aggregate {summary['mean_time_aggregate']:.4f}s, eval {summary['mean_time_eval']:.3f}s"
        )
    if summary.get("domains"):
        missing = summary.get("domains_missing") or []
        console.print(
            f"domains: {', '.join(summary['domains'])}"
            + (f" [bold yellow](missing, no files found: {', '.join(missing)})[/]" if missing else ""),
            highlight=False,
        )
    console.print(
        f"results: {run_dir}/ (config.yaml, metrics.jsonl, summary.json)" + (f"; database {cfg.db}" if cfg.db else "")
    )


def _one_line(text: str, cols: int) -> str:
    """``text`` cut at a word to fit ``cols`` columns, ending in " …" when cut."""
    if len(text) <= cols:
        return text
    cut = text[: cols - 2]
    return (cut[: cut.rfind(" ")] if " " in cut.strip() else cut).rstrip(" ,;(") + " …"


def cmd_methods(args: argparse.Namespace) -> int:
    if args.names:
        from fedskew.method_detail import describe

        cols = max(60, shutil.get_terminal_size((100, 24)).columns)
        try:
            print("\n\n".join(describe(name, cols) for name in args.names))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    from fedskew.method_index import method_index

    index = method_index()  # without importing the methods (fedskew/method_index.py)
    rows, valid, refused = index["rows"], index["valid"], index["refused"]
    name_width = max(len(r[0]) for r in rows)
    # every line fits the terminal (piped: 100 columns); a summary wraps under its own column
    cols = max(60, shutil.get_terminal_size((100, 24)).columns)

    def fill(text: str, first: str = "", rest: str = "") -> str:
        return textwrap.fill(text, cols, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)

    print(fill("Methods compose as CLIENT[+PLUGIN...]; a name without a client part uses fedavg's local SGD."))
    print(fill("Hyper-parameters: -m KEY=VALUE (see docs/methods.md).") + "\n")
    kinds: dict[str, list[tuple[str, str]]] = {}  # the parts by kind, in the registry's order
    for name, kind, summary in rows:
        kinds.setdefault(kind, []).append((name, summary))
    for kind, parts in kinds.items():
        print(f"{kind}:")
        for name, summary in parts:  # one line each, cut to the terminal: `fedskew methods NAME` has the rest
            print(_one_line(f"  {name:<{name_width}}  {summary}", cols))
    print(fill("The details of one (paper, hyper-parameters, defaults, DP): fedskew methods NAME [NAME ...]"))
    if args.compositions:
        print("\nvalid compositions:")
        print(fill(", ".join(valid), "  ", "  "))
        print("refused:")
        for line in refused:
            print(fill(line, "  ", "    "))
        private = index.get("private", [])
        print()
        print(fill(f"can run under user-level differential privacy (--dp-clip; docs/privacy.md), {len(private)}:"))
        print(fill(", ".join(private), "  ", "  "))
    else:
        print()
        print(
            fill(
                f"{len(valid)} valid compositions of a client part and a plug-in (or two plug-ins), {len(refused)} "
                f"refused with a reason; {len(index.get('private', []))} of the valid ones can run under --dp-clip: "
                "`fedskew methods --compositions` lists them"
            )
        )
    # the Flower apps run any composition with the simulator's own objects (docs/flower.md)
    import importlib.util

    extra = "" if importlib.util.find_spec("flwr") else ' (install the extra: pip install -e ".[flower]")'
    print()
    print(
        fill(
            f"on Flower (`fedskew flower`{extra}): every valid composition, with the simulator's metrics; "
            "`fedskew flower check [METHOD ...]` compares them"
        )
    )
    return 0


def cmd_skew(args: argparse.Namespace) -> int:
    from fedskew.results.plots import skew_figure

    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "skew.png"
    try:
        summary = skew_figure(run_dir, out, args.layer, args.round, args.positions)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"round {summary['round']}: share of high-dispersion positions (H/M) per layer")
    for name, info in summary["layers"].items():
        print(f"  {name:<40} M={info['M']:>9}  H/M={info['high_frac']:.2e}")
    print(f"figure: {out}")
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from fedskew.recorder import record_in_db

    for run_dir in args.run_dirs:
        added = record_in_db(args.db, run_dir)
        print(f"{run_dir}: {'recorded in' if added else 'already in'} {args.db}")
    return 0


def _footer(v: tuple[float, float, int] | None) -> str:
    return "-" if v is None else f"{v[0]:.2f} (n={v[2]}, pooled paired sd {v[1]:.2f})"


def cmd_report(args: argparse.Namespace) -> int:
    from fedskew.results.report import ReportError, report_from_db
    from fedskew.results.store import ResultsDB

    if not Path(args.db).is_file():
        print(f"error: no results database at {args.db}", file=sys.stderr)
        return 2
    if args.last_n is not None and args.last_n < 1:
        print(f"error: --last-n must be a positive number of rounds, got {args.last_n}", file=sys.stderr)
        return 2
    if args.seeds_needed is not None and not args.seeds_needed > 0:
        print(
            f"error: --seeds-needed must be a positive difference in points, got {args.seeds_needed}", file=sys.stderr
        )
        return 2
    metrics = [m.strip() for item in (args.metric or ["global_acc"]) for m in item.split(",") if m.strip()]
    with ResultsDB(args.db, read_only=True) as db:  # a report only reads: no schema change, read-only storage fine
        try:
            rep = report_from_db(db, metrics, last_n=args.last_n, against=args.against, seeds_needed=args.seeds_needed)
            if args.plot:
                from fedskew.results.plots import report_figures

                figures = report_figures(db, args.plot, metrics, last_n=args.last_n, against=args.against)
        except ReportError as exc:  # --against naming no row
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(rep.render(args.format))
    if args.format == "csv" and rep.rows:  # the CSV holds the table only; what it shares goes to stderr
        print(f"settings common to every row: {'; '.join(rep.common) or '-'}", file=sys.stderr)
        for note in rep.notes:
            print(f"note: {note}", file=sys.stderr)
        if rep.footer is not None:  # the table's last line: each column's detectable difference
            shown = [
                f"{c}: {_footer(v)}" for c, v, k in zip(rep.columns, rep.footer, rep.kinds, strict=True) if k == "delta"
            ]
            print(f"note: {rep.footer[0]}: {'; '.join(shown)}", file=sys.stderr)
    if args.plot:  # on stderr: stdout stays the table (`--format csv > t.csv`)
        print(f"{len(figures)} figure(s) in {args.plot}/ (each with a .json of its numbers):", file=sys.stderr)
        for fig in figures:
            print(f"  {fig.path}", file=sys.stderr)
    sys.stdout.flush()  # a closed pipe (`fedskew report | head`) shows here, inside main's handler
    return 0


# the errors a command reports in one line (exit 2; a database write after the compute: exit 4), by module: a module
# that was never imported raised none of them, so they are looked up only in the modules loaded (a command that
# needs no torch, e.g. `fedskew methods`, does not import fedskew.protocol to name its UploadError)
_ERRORS = (
    ("fedskew.schema", "ConfigError"),
    ("fedskew.data.readers.base", "DataError"),
    ("fedskew.data.partition.base", "PartitionError"),
    ("fedskew.protocol", "UploadError"),
    ("fedskew.results.rundir", "RunDirError"),
    ("fedskew.results.store", "DatabaseError"),
    ("fedskew.engine.state_files", "StoreDirError"),
    ("fedskew.flower.loopback", "LoopbackError"),  # a loopback federation's run failed: Flower's report follows
)


def _expected_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    recorder = sys.modules.get("fedskew.recorder")
    after = (recorder.DatabaseWriteError,) if recorder is not None else ()
    found: list[type[BaseException]] = [FileExistsError, FileNotFoundError]
    for module, name in _ERRORS:
        loaded = sys.modules.get(module)
        if loaded is not None:
            found.append(getattr(loaded, name))
    return after, tuple(found)


def _note(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    """How a command prints a warning (a domain without files, a composition trained one client at a time): one
    ``note:`` line on stderr, not Python's ``file:line: Category`` header and the raw source line under it."""
    print(f"note: {message}", file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # --help and bad flags end here, before torch is imported
    command = args.command or "run"
    if args.command is None:  # `fedskew` alone = the main job
        args = build_parser().parse_args(["run", *(argv or [])])
    handlers = {
        "run": cmd_run,
        "methods": cmd_methods,
        "report": cmd_report,
        "skew": cmd_skew,
        "db": cmd_db,
    }
    for module in _command_modules():
        handlers.update(module.HANDLERS)
    import warnings

    shown, warnings.showwarning = warnings.showwarning, _note  # a command's warnings read as notes
    try:
        return handlers[command](args)
    except KeyboardInterrupt:
        print("interrupted before the first round finished; nothing was kept for this run", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of stdout went away (`fedskew report | head`): stop quietly, with the status a process killed
        # by SIGPIPE has (128 + 13), as `yes | head` does; stdout goes to devnull so the exit flush cannot fail again
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception as exc:  # after the two above (a closed pipe is an OSError too)
        after_compute, expected = _expected_errors()
        if isinstance(exc, after_compute):  # after the compute: the run directory is complete
            print(f"error: {exc}", file=sys.stderr)
            return 4
        if isinstance(exc, expected):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise
    finally:
        warnings.showwarning = shown  # main() called in a process that goes on (tests, notebooks) leaves it as it was


if __name__ == "__main__":
    raise SystemExit(main())
