"""``fedskew`` command line: ``run`` (the main job) here, the other subcommands in :mod:`fedskew.commands`. Thin: parse,
validate, call, print."""

from __future__ import annotations

import argparse
import sys
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
        "--cudnn-benchmark",
        action="store_true",
        help="on a CUDA device, let cuDNN time its convolution algorithms per shape and keep the fastest "
        "(engine/kernels.py; the float rounding may differ from run to run)",
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

    for module in _command_modules():
        module.add_parsers(sub)
    return p


# subcommands defined next to what they drive: each module has add_parsers(sub) and HANDLERS (name -> handler)
COMMAND_MODULES = (
    "fedskew.commands.methods",
    "fedskew.commands.results",
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
        f"{cfg.rounds} rounds, seed {cfg.seed}"
        + (f", {cfg.precision} training passes)" if cfg.precision != "float32" else ")")
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
