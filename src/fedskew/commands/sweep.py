"""``fedskew sweep SPEC.yaml`` and ``fedskew reproduce PAPER``: many runs with one progress display, one database,
failures listed at the end (the others go on), and the table they add up to."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

SCALE_HELP = (
    "smoke: a pipeline check on a small subset (minutes on a CPU); laptop: the paper's protocol on the embedded 8x8 "
    "digits, offline (6 to 17 minutes per paper on 2 cores with --jobs 2); cpu: the paper's protocol on MNIST / "
    "Fashion-MNIST with their official test sets and 5 seeds, sized to resolve differences (measured on 2 cores with "
    "--jobs 2: 1 to 1.5 hours per paper, fedsa 2.5; needs those files); small: a stated reduction (about an hour on "
    "one GPU); paper: the paper's rounds, local epochs, clients and model"
)
JOBS_HELP = (
    "runs at a time, each in its own process (default: 1 on the CPU; on CUDA 8 per visible GPU, at most one per CPU "
    "core, the level benchmarks/runs_per_gpu.py measured best)"
)


def add_parsers(sub: Any) -> None:
    from fedskew.reproduce.papers import SCALES

    sw = sub.add_parser(
        "sweep",
        help="run a grid of experiments from a YAML spec (docs/sweeps.md), idempotently, into one database",
        description="Runs every point of the spec's cases x zip x grid x methods x seeds, --jobs at a time. A "
        "finished run is skipped, an interrupted one resumed; a failed run is listed at the end and the others go "
        "on. Ctrl-C checkpoints the running runs; the same command continues.",
    )
    sw.add_argument("spec", help="the sweep spec (YAML)")
    sw.add_argument("--jobs", "-j", type=int, default=None, help=JOBS_HELP)
    sw.add_argument("--out", default=None, help="root of the run directories (default: the spec's out)")
    sw.add_argument("--db", default=None, help="the results database (default: the spec's db, or OUT/fedskew.db)")
    sw.add_argument("--metric", action="append", default=None, help="metric(s) of the final table (default: spec's)")
    sw.add_argument(
        "--tuned", default=None, help="tuned.yaml of `fedskew tune`: runs take their method's tuned arguments"
    )
    sw.add_argument("--log", default=None, help="live loggers of every run: tensorboard,mlflow,wandb (docs/loggers.md)")
    sw.add_argument(
        "--device", default=None, help="every run's device: cpu, cuda (--jobs N: one GPU per worker), cuda:1"
    )
    add_executor_flags(sw)
    add_stack_flag(sw)
    sw.add_argument("--dry-run", action="store_true", help="list the runs and what would happen to each; run nothing")
    sw.add_argument("--quiet", action="store_true", help="no progress display")

    rp = sub.add_parser(
        "reproduce",
        help="a paper's main tables as a sweep, printed with the paper's numbers beside ours",
        description="Runs the tables of PAPER (fedsa, feddisco, fedcac, fedheal, niid-bench) over the settings whose "
        "data is present, at a chosen scale, and writes the tables (ours beside the paper's), the orderings, the "
        "compute against the paper's and the figures to --out. Methods or datasets this version lacks are listed, not "
        "dropped. Idempotent like `fedskew sweep`.",
    )
    rp.add_argument("paper", help="fedsa (fedpake), feddisco, fedcac, fedheal or niid-bench (a benchmark)")
    rp.add_argument("--scale", choices=SCALES, default="smoke", help=SCALE_HELP)
    rp.add_argument("--jobs", "-j", type=int, default=None, help=JOBS_HELP)
    rp.add_argument("--out", default=None, help="output folder (default runs/reproduce/PAPER-SCALE)")
    rp.add_argument("--data-dir", default=None, help="dataset folder (default $FEDSKEW_DATA)")
    rp.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available, else cpu)")
    rp.add_argument("--seeds", default=None, help="comma-separated seeds (default: the scale's)")
    rp.add_argument(
        "--rows",
        default=None,
        help="only these rows, comma-separated (ids or methods, e.g. fedavg,fedavg+disco); a method's name selects "
        "every row of that method, its controls and variants too (fedavg: fedavg_uniform as well); =ID selects that "
        "row alone (niid-bench: =fedprox is FedProx mu 0.01 without the mu 0.001 row); the run ids do not depend on "
        "the selection, so a later full run reuses these runs",
    )
    rp.add_argument(
        "--settings",
        default=None,
        help="only these settings (table columns), comma-separated ids, e.g. mnist_dir,mnist_c1 (--dry-run lists them)",
    )
    rp.add_argument(
        "--tuned",
        default=None,
        help="tuned.yaml of `fedskew tune`: rows take their method's tuned arguments (default out: ...-tuned)",
    )
    rp.add_argument(
        "--against",
        metavar="ROW",
        default=None,
        help="the reference row of the paired differences in the tables (a row id, label or method; default: FedAvg, "
        "and a host+plug-in row against its host)",
    )
    rp.add_argument("--log", default=None, help="live loggers of every run: tensorboard,mlflow,wandb (docs/loggers.md)")
    add_executor_flags(rp)
    add_stack_flag(rp)
    rp.add_argument("--dry-run", action="store_true", help="show the plan and the runs; run nothing")
    rp.add_argument(
        "--table-only",
        action="store_true",
        help="write the tables of the runs already finished in --out (a stopped sweep, or one still running); run "
        "nothing",
    )
    rp.add_argument("--quiet", action="store_true", help="no progress display")


def add_stack_flag(p: Any) -> None:
    p.add_argument(
        "--stack-seeds",
        nargs="?",
        const="on",
        choices=("on", "auto"),
        default=None,
        help="run the seeds of each experiment together, their clients trained as rows of one batched step (each run "
        "recorded as a --batched-clients run; a group takes one of --jobs; local executor; docs/sweeps.md); "
        "'--stack-seeds auto': each experiment's seeds stacked or as separate runs, by what a short probe of both "
        "measures faster",
    )


def add_executor_flags(p: Any) -> None:
    p.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="local: --jobs processes on this machine; ray: each run a Ray task anywhere in a Ray cluster, its files "
        "and database rows written here (extra [ray]; docs/sweeps.md)",
    )
    p.add_argument(
        "--address",
        default=None,
        help="--executor ray: the cluster (HOST:PORT, auto; default auto when RAY_ADDRESS is set, else a Ray "
        "instance on this machine with --jobs CPUs)",
    )
    p.add_argument(
        "--gpus-per-run",
        type=float,
        default=None,
        help="--executor ray: GPUs each run reserves (default 1 with a cuda device, else 0; 0.5: two runs per GPU)",
    )


def make_executor(args: argparse.Namespace, jobs: int | None, device: str | None) -> Any:
    """The Ray executor the flags ask for (``None``: the local pool); refuses Ray-only flags without it."""
    if args.executor != "ray":
        if args.address or args.gpus_per_run is not None:
            from fedskew.config import ConfigError

            raise ConfigError("--address and --gpus-per-run go with --executor ray")
        return None
    if getattr(args, "stack_seeds", False):
        from fedskew.config import ConfigError

        raise ConfigError("--stack-seeds runs each group of seeds in one local process: not with --executor ray")
    from fedskew.sweep.ray import RayExecutor, check_ray

    check_ray()  # a clear message, before anything else, when Ray is not installed
    return RayExecutor(address=args.address, jobs=jobs, device=device, gpus_per_run=args.gpus_per_run)


class Display:
    """One rich progress display: a bar over all runs, and one bar per running run with its round and accuracy.
    Notes (a missing domain, a taken-over lock) are printed once each, above the bars."""

    def __init__(self, total: int, quiet: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from fedskew.commands import console as make_console

        self.console = make_console(stderr=True, soft_wrap=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=quiet,
        )
        self.overall = self.progress.add_task("runs", total=total, info="")
        self.tasks: dict[str, Any] = {}
        self.seen: set[str] = set()
        self.counts: dict[str, int] = {}
        self.labels: dict[str, str] = {}
        self.done: set[str] = set()  # a worker's last events may arrive after its result: never re-add a bar
        self.lock = threading.Lock()  # events come from the pool's listener thread, results from the main one

    def __enter__(self) -> Display:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def event(self, ev: tuple[Any, ...]) -> None:
        with self.lock:
            self._event(ev)

    def _event(self, ev: tuple[Any, ...]) -> None:
        kind, name = ev[0], ev[1]
        if kind == "start" and name not in self.done:
            if name in self.tasks:  # started again (its Ray worker died): one bar
                self.progress.remove_task(self.tasks.pop(name))
            label = self.labels.get(name, name)
            self.tasks[name] = self.progress.add_task(f"  {label}", total=ev[3], completed=ev[2] - 1, info="")
        elif kind == "round" and name in self.tasks:
            self.progress.update(self.tasks[name], completed=ev[2], info=ev[3])
        elif kind == "note" and ev[2] not in self.seen:
            self.seen.add(ev[2])
            self.console.print(f"note ({self.labels.get(name, name)}): {ev[2]}", highlight=False, markup=False)

    def result(self, res: Any) -> None:
        with self.lock:
            self.done.add(res.name)
            if res.name in self.tasks:
                self.progress.remove_task(self.tasks.pop(res.name))
        self.counts[res.status] = self.counts.get(res.status, 0) + 1
        info = ", ".join(f"{n} {s}" for s, n in self.counts.items())
        self.progress.update(self.overall, advance=1, info=info)
        if res.status == "failed":
            from rich.markup import escape

            what = escape(f"{self.labels.get(res.name, res.name)}: {res.error}")
            self.console.print(f"[red]failed[/]: {what}", highlight=False)


def tuned_note(runs: list[Any], path: str) -> str:
    """Which methods took tuned arguments from ``path`` (and which), and which found no entry for their setting."""
    from fedskew.tuning.tuned import format_args

    took: dict[str, str] = {}
    none: set[str] = set()
    for r in runs:
        if r.tuned:
            took[r.label.rsplit(" s", 1)[0]] = format_args({**r.tuned["args"], **r.tuned["run"]}) or "(nothing new)"
        else:
            none.add(r.cfg.method)
    lines = [f"tuned arguments from {path}:"]
    lines += [f"  {m}: {a}" for m, a in took.items()]
    if none:
        lines.append(f"  no tuned entry for their setting: {', '.join(sorted(none))} (their defaults)")
    return "\n".join(lines)


def with_device(runs: list[Any], device: str) -> list[Any]:
    """The runs on ``device`` (``--device``: where they run, not what they compute, so the same folders)."""
    from fedskew.config import make_config
    from fedskew.sweep.core import PlannedRun

    return [
        PlannedRun(r.name, make_config({**r.cfg.model_dump(), "device": device}), r.label, r.point, r.tuned)
        for r in runs
    ]


def default_jobs(runs: list[Any]) -> int:
    """Runs at a time when neither --jobs nor the spec says (:func:`fedskew.sweep.pool.default_jobs`)."""
    from fedskew.sweep.pool import default_jobs as by_devices

    return by_devices([r.cfg.device for r in runs])


def at_a_time(jobs: int, given: int | None) -> str:
    return f"{jobs} at a time" + ("" if given or jobs == 1 else " (the default on CUDA; --jobs to change)")


def _states(runs: list[Any]) -> list[str]:
    from fedskew.sweep.core import run_state

    lines = []
    for run in runs:
        state, detail = run_state(run)
        word = {"done": "skip", "new": "run", "resume": "resume", "restart": "start over", "blocked": "blocked"}[state]
        lines.append(f"  {word:<10} {run.name}" + (f"  ({detail})" if detail else ""))
    return lines


def _run_all(runs: list[Any], jobs: int, quiet: bool, executor: Any = None, stack_seeds: bool | str = False) -> Any:
    from fedskew.sweep.core import run_sweep

    with Display(len(runs), quiet) as display:
        display.labels = {r.name: r.label for r in runs}
        return run_sweep(
            runs,
            jobs=jobs,
            on_event=display.event,
            on_result=display.result,
            executor=executor,
            stack_seeds=stack_seeds,
        )


def _closing(outcome: Any, log_dir: Path) -> int:
    """Print the counts and the failures with their errors; write the tracebacks; the exit status."""
    counts: dict[str, int] = {}
    for r in outcome.results:
        counts[r.status] = counts.get(r.status, 0) + 1
    resumed = sum(1 for r in outcome.results if r.detail == "resumed")
    print(
        f"\n{len(outcome.results)} runs: "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + (f" ({resumed} resumed from a checkpoint)" if resumed else "")
    )
    for r in outcome.by_status("diverged"):
        print(f"diverged: {r.name} (kept, flagged in the table)")
    if outcome.failed:
        log = log_dir / "failures.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(f"== {r.name} ({r.run_dir})\n{r.trace or r.error}\n" for r in outcome.failed))
        print(f"\n{len(outcome.failed)} run(s) failed (tracebacks in {log}):", file=sys.stderr)
        for r in outcome.failed:
            print(f"  {r.name}: {r.error}", file=sys.stderr)
    if outcome.interrupted:
        print("interrupted: the running runs checkpointed; the same command continues them", file=sys.stderr)
        return 130
    return 1 if outcome.failed else 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from fedskew.config import ConfigError
    from fedskew.results.report import build_report
    from fedskew.results.store import ResultsDB
    from fedskew.sweep.core import expand, load_spec, with_log

    spec = load_spec(args.spec)
    if args.tuned:
        spec = spec.model_copy(update={"tuned": args.tuned})
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
    # on Ray, --device applies on the nodes (this machine may have no GPU); --jobs caps the runs at a time
    executor = make_executor(args, args.jobs or spec.jobs, args.device)
    runs = with_log(expand(spec, out=args.out, db=args.db), args.log)
    if args.device and executor is None:
        runs = with_device(runs, args.device)
    jobs = args.jobs or spec.jobs or default_jobs(runs)
    db = runs[0].cfg.db if runs else None
    at = f"on {executor.where()}" if executor else at_a_time(jobs, args.jobs or spec.jobs)
    print(f"sweep {spec.name}: {len(runs)} runs, {at}; database {db}", file=sys.stderr)
    if spec.tuned:
        print(tuned_note(runs, spec.tuned), file=sys.stderr)
    if args.dry_run:
        print("\n".join(_states(runs)))
        return 0
    outcome = _run_all(runs, jobs, args.quiet, executor, args.stack_seeds)
    ids = set(outcome.run_ids())
    if ids and db and Path(db).is_file():
        with ResultsDB(db) as store:
            mine = [r for r in store.runs() if r["run_id"] in ids]
        metrics = [m.strip() for item in (args.metric or spec.metrics) for m in item.split(",") if m.strip()]
        print(build_report(mine, metrics).render("markdown"))
    root = Path(str(runs[0].cfg.out)).parent if runs else Path(".")
    return _closing(outcome, root)


def cmd_reproduce(args: argparse.Namespace) -> int:
    import torch

    from fedskew.config import ConfigError
    from fedskew.reproduce import load_paper, make_plan, planned_runs, run_reproduction, tabulate
    from fedskew.reproduce.table import check_against

    paper = load_paper(args.paper)
    check_against(paper, args.against)
    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    except ValueError:
        raise ConfigError(f"--seeds expects comma-separated integers, got {args.seeds!r}") from None
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
    executor = make_executor(args, args.jobs if args.jobs and args.jobs > 1 else None, args.device)
    device = args.device or ("cuda" if torch.cuda.is_available() and args.scale != "smoke" else None)
    if executor is not None:
        device = None  # on Ray, --device applies on the nodes
    rows = args.rows.split(",") if args.rows else None
    plan = make_plan(
        paper,
        args.scale,
        out=args.out,
        data_dir=args.data_dir,
        device=device,
        seeds=seeds,
        rows=rows,
        tuned=args.tuned,
        settings=args.settings.split(",") if args.settings else None,
    )
    plan.against = args.against
    plan.log = args.log
    print(f"{paper.paper}: {paper.title}", file=sys.stderr)
    print(f"scale {args.scale}: {paper.scales[args.scale].note.strip()}", file=sys.stderr)
    shown = [s.setting.label + (f" (domains: {', '.join(s.domains)})" if s.domains else "") for s in plan.settings]
    print(f"settings: {'; '.join(shown) or 'none'}", file=sys.stderr)
    for sid, why in plan.missing_settings:
        print(f"  setting {paper.settings[sid].label}: {why}", file=sys.stderr)
    print(f"methods: {', '.join(r.label for r in plan.rows) or 'none'}", file=sys.stderr)
    for r, why in plan.missing_rows:
        print(f"  method {r.label} ({r.method}): {why}", file=sys.stderr)
    if not plan.settings or not plan.rows:
        print("error: nothing to run here (see the reasons above)", file=sys.stderr)
        return 2
    runs = planned_runs(plan)
    jobs = args.jobs or default_jobs(runs)
    at = f"on {executor.where()}" if executor else at_a_time(jobs, args.jobs)
    print(f"{len(runs)} runs, {at}, into {plan.out}/", file=sys.stderr)
    if plan.tuned:
        print(tuned_note(runs, plan.tuned), file=sys.stderr)
    if args.dry_run:
        print("\n".join(_states(runs)))
        return 0
    if args.table_only:
        rep = tabulate(plan)
        done = len(rep.outcome.by_status("skipped"))
        print(rep.markdown)
        print(
            f"{done} of {len(runs)} runs finished; written: {', '.join(str(p) for p in rep.files[:2])}", file=sys.stderr
        )
        return 0
    with Display(len(runs), args.quiet) as display:
        display.labels = {r.name: r.label for r in runs}
        rep = run_reproduction(
            plan,
            jobs=jobs,
            on_event=display.event,
            on_result=display.result,
            executor=executor,
            stack_seeds=args.stack_seeds,
        )
    print(rep.markdown)
    print(f"written: {', '.join(str(p) for p in rep.files[:3])}; {len(rep.files) - 3} figure(s) in {plan.out}/figures/")
    return _closing(rep.outcome, plan.out)


HANDLERS = {"sweep": cmd_sweep, "reproduce": cmd_reproduce}
