"""The commands that read finished runs: ``fedskew report`` (the table of experiments with paired differences),
``fedskew skew`` (a run's parameter-skew figure) and ``fedskew db import`` (record run directories)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parsers(sub: Any) -> None:
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
        print(
            f"error: no results database at {args.db}: `fedskew run` (or sweep, reproduce) records each run there; "
            "--db names another",
            file=sys.stderr,
        )
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


HANDLERS = {"skew": cmd_skew, "db": cmd_db, "report": cmd_report}
