"""Live loggers (``log: [tensorboard, mlflow, wandb]``, ``--log``): the engine's round records, as they are written
to ``metrics.jsonl``, also go to the trackers a lab already uses. One interface, :class:`RunLogger`, fed by
:class:`Loggers` from the run loop (``fedskew.runner.run_experiment``); no second metrics path.

Each tracker writes locally unless told otherwise: TensorBoard event files in ``RUN_DIR/tb``; MLflow a file store
``<runs root>/mlruns`` (``log_uri`` or ``MLFLOW_TRACKING_URI`` pick another store or a server), one experiment per
group; W&B offline runs in ``RUN_DIR/wandb`` (``WANDB_MODE=online`` and ``WANDB_ENTITY``/``WANDB_PROJECT`` to sync
live), grouped by the group. A logger that fails warns once and is switched off; the run goes on."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fedskew.schema import ConfigError


@dataclass
class LogContext:
    """What a logger may show at the start besides the configuration: the run's id, the first round this call runs
    (> 1 when resumed), and the partition's bubble plot (a PNG, or ``None`` when it could not be drawn)."""

    run_id: str
    first_round: int = 1
    partition_png: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class RunLogger(Protocol):
    """A tracker: ``start`` once before the first round it sees, ``round`` per finished round (its record, the
    per-client scores, the skew probe: a :class:`fedskew.engine.rounds.RoundResult`), ``end`` with the summary of an
    ended run, ``close`` always (also after a failure or an interruption, without ``end``)."""

    def start(self, cfg: Any, run_dir: Path, group: str, ctx: LogContext) -> None: ...

    def round(self, result: Any) -> None: ...

    def end(self, summary: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


# ---- what is logged, the same for every tracker ------------------------------------------------------------------
def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def flat_params(cfg: Any) -> dict[str, Any]:
    """The run's configuration as hyper-parameters: scalars as they are, ``method_args`` flattened
    (``method_args.mu``), lists as JSON text."""
    out: dict[str, Any] = {}
    for k, v in cfg.model_dump().items():
        items = [(f"method_args.{a}", x) for a, x in v.items()] if k == "method_args" else [(k, v)]
        for key, x in items:
            out[key] = x if x is None or isinstance(x, bool | int | float | str) else json.dumps(x, default=str)
    return out


def round_scalars(record: dict[str, Any]) -> dict[str, float]:
    """Every numeric value of a round's record (accuracy views, losses, timings, bytes, per-domain accuracies);
    nested dicts (``diagnostics``) flattened with ``/``. Lists (client weights) are histograms, not scalars."""
    out: dict[str, float] = {}

    def walk(prefix: str, d: dict[str, Any]) -> None:
        for k, v in d.items():
            if k == "round":
                continue
            if _number(v):
                out[prefix + k] = float(v)
            elif isinstance(v, dict):
                walk(f"{prefix}{k}/", v)

    walk("", record)
    return out


def round_histograms(result: Any) -> dict[str, list[float]]:
    """Per-client series of a round: each evaluation view's client accuracies (``clients/<view>_acc``) and the
    server's per-client lists (``diagnostics/weights`` of Disco, HEAL, AFL)."""
    out: dict[str, list[float]] = {}
    for view, scores in (result.client_scores or {}).items():
        counted = [float(a) for a, n in zip(scores.accuracy, scores.count, strict=True) if n > 0]
        if counted:
            out[f"clients/{view}_acc"] = counted
    for k, v in (result.record.get("diagnostics") or {}).items():
        if isinstance(v, list) and v and all(_number(x) for x in v):
            out[f"diagnostics/{k}"] = [float(x) for x in v]
    return out


def probe_scalars(probe: dict[str, Any] | None) -> dict[str, float]:
    """The skew probe's share of high-dispersion positions per layer (``skew/<layer>/high_frac``)."""
    layers = (probe or {}).get("layers") or {}
    return {f"skew/{name}/high_frac": float(info["high_frac"]) for name, info in layers.items() if "high_frac" in info}


def summary_scalars(summary: dict[str, Any]) -> dict[str, float]:
    """The summary's numbers: ``summary/<metric>/<statistic>`` and the top-level numbers (wall time, ...)."""
    out: dict[str, float] = {}
    for k, v in summary.items():
        if _number(v):
            out[f"summary/{k}"] = float(v)
        elif isinstance(v, dict) and k != "headline":
            out.update({f"summary/{k}/{s}": float(x) for s, x in v.items() if _number(x)})
    head = summary.get("headline") or {}
    if _number(head.get("value")):
        out["summary/headline"] = float(head["value"])
    return out


# ---- TensorBoard ----------------------------------------------------------------------------------------------
class TensorBoardLogger:
    """Event files in ``RUN_DIR/tb`` (``tensorboard --logdir runs/``): scalars, client histograms, the partition
    image, the configuration as text and, at the end, the hyper-parameters with the summary's headline."""

    def start(self, cfg: Any, run_dir: Path, group: str, ctx: LogContext) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed (or overwritten) run's rounds after the checkpoint replace the old events
        self.w = SummaryWriter(log_dir=str(run_dir / "tb"), purge_step=ctx.first_round)
        self.params = flat_params(cfg)
        self.w.add_text("config", "\n".join(f"    {k}: {v}" for k, v in self.params.items()), ctx.first_round)
        if group:
            self.w.add_text("group", group, ctx.first_round)
        if ctx.partition_png is not None and ctx.first_round == 1:
            import matplotlib.image

            self.w.add_image("partition", matplotlib.image.imread(ctx.partition_png)[..., :3], 0, dataformats="HWC")

    def round(self, result: Any) -> None:
        rnd = int(result.record["round"])
        for k, v in {**round_scalars(result.record), **probe_scalars(result.probe)}.items():
            self.w.add_scalar(k, v, rnd)
        import numpy as np

        for k, v in round_histograms(result).items():
            self.w.add_histogram(k, np.asarray(v), rnd)
        self.w.flush()

    def end(self, summary: dict[str, Any]) -> None:
        self.w.add_text("summary", json.dumps(summary, indent=1, default=str).replace("\n", "\n    "))
        params = {k: (v if isinstance(v, bool | int | float | str) else str(v)) for k, v in self.params.items()}
        metrics = {k: v for k, v in summary_scalars(summary).items() if math.isfinite(v)}
        self.w.add_hparams(params, metrics, run_name=".")  # "." : into this run's own folder

    def close(self) -> None:
        if hasattr(self, "w"):
            self.w.close()


# ---- MLflow -------------------------------------------------------------------------------------------------------
def mlflow_uri(cfg: Any, run_dir: Path) -> str:
    """``log_uri``, else ``MLFLOW_TRACKING_URI``, else a file store ``mlruns`` next to the run directory."""
    return cfg.log_uri or os.environ.get("MLFLOW_TRACKING_URI") or (run_dir.resolve().parent / "mlruns").as_uri()


class MLflowLogger:
    """One MLflow run per fedskew run (tagged ``fedskew.run_id``; a resumed run continues it) in the experiment
    named by the group: the configuration as params, every round's numbers as metrics at step = round, the summary
    as metrics and ``summary.json``, the partition plot as an artifact."""

    def start(self, cfg: Any, run_dir: Path, group: str, ctx: LogContext) -> None:
        uri = mlflow_uri(cfg, run_dir)
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow >= 3.x: the file store is opt-in
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.c = MlflowClient(tracking_uri=uri)
        name = group or "fedskew"
        exp = self.c.get_experiment_by_name(name)
        if exp is None:
            try:
                exp_id = self.c.create_experiment(name)
            except Exception:  # noqa: BLE001 - another process of the sweep created it first
                exp = self.c.get_experiment_by_name(name)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        tag = f"tags.`fedskew.run_id` = '{ctx.run_id}'"
        found = self.c.search_runs([exp_id], tag, max_results=1) if ctx.first_round > 1 else []
        if found:
            self.run_id = found[0].info.run_id
            return
        run = self.c.create_run(
            exp_id, run_name=run_dir.name, tags={"fedskew.run_id": ctx.run_id, "fedskew.run_dir": str(run_dir)}
        )
        self.run_id = run.info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flat_params(cfg).items()]
        for i in range(0, len(params), 100):
            self.c.log_batch(self.run_id, params=params[i : i + 100])
        if ctx.partition_png is not None:
            self.c.log_artifact(self.run_id, str(ctx.partition_png))

    def _metrics(self, values: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        ms = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(ms), 1000):
            self.c.log_batch(self.run_id, metrics=ms[i : i + 1000])

    def round(self, result: Any) -> None:
        self._metrics({**round_scalars(result.record), **probe_scalars(result.probe)}, int(result.record["round"]))

    def end(self, summary: dict[str, Any]) -> None:
        self._metrics(summary_scalars(summary), int(summary.get("rounds") or 0))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "summary.json"
            path.write_text(json.dumps(summary, indent=1, default=str))
            self.c.log_artifact(self.run_id, str(path))
        self.c.set_terminated(self.run_id, "FINISHED")
        self.ended = True

    def close(self) -> None:
        if hasattr(self, "run_id") and not getattr(self, "ended", False):
            self.c.set_terminated(self.run_id, "KILLED")


# ---- Weights & Biases ------------------------------------------------------------------------------------------
class WandbLogger:
    """A W&B run in ``RUN_DIR/wandb``, offline unless ``WANDB_MODE`` says otherwise (``wandb sync RUN_DIR/wandb/
    offline-run-*`` uploads it later), in project ``WANDB_PROJECT`` (default fedskew) and the group: the
    configuration, every round's numbers and client histograms at step = round, the partition image, the summary."""

    def start(self, cfg: Any, run_dir: Path, group: str, ctx: LogContext) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "fedskew"),
            entity=os.environ.get("WANDB_ENTITY") or None,
            mode=os.environ.get("WANDB_MODE", "offline"),
            dir=str(run_dir),
            group=group or None,
            name=run_dir.name,
            config=flat_params(cfg),
            tags=[f"fedskew:{ctx.run_id}"],
            reinit="create_new" if _wandb_new_reinit(wandb) else True,
        )
        if ctx.partition_png is not None:
            self.run.log({"partition": wandb.Image(str(ctx.partition_png))}, step=ctx.first_round - 1)

    def round(self, result: Any) -> None:
        data: dict[str, Any] = {**round_scalars(result.record), **probe_scalars(result.probe)}
        data.update({k: self.wandb.Histogram(v) for k, v in round_histograms(result).items()})
        self.run.log(data, step=int(result.record["round"]))

    def end(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(summary_scalars(summary))
        self.run.finish()
        self.ended = True

    def close(self) -> None:
        if hasattr(self, "run") and not getattr(self, "ended", False):
            self.run.finish(exit_code=1)


def _wandb_new_reinit(wandb: Any) -> bool:
    from packaging.version import Version

    return Version(wandb.__version__) >= Version("0.19.10")


# ---- the registry and the driver --------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoggerSpec:
    make: Callable[[], RunLogger]
    modules: tuple[str, ...]  # what must be importable
    extra: str  # the pip extra that installs it


LOGGERS: dict[str, LoggerSpec] = {
    "tensorboard": LoggerSpec(TensorBoardLogger, ("tensorboard",), "tensorboard"),
    "mlflow": LoggerSpec(MLflowLogger, ("mlflow",), "mlflow"),
    "wandb": LoggerSpec(WandbLogger, ("wandb",), "wandb"),
}


def parse_names(value: str | Iterable[str] | None) -> list[str]:
    """``"tensorboard,mlflow"`` or a list: the logger names, deduplicated in order; unknown names refused."""
    if value is None:
        return []
    if isinstance(value, str) and value.strip().startswith("["):  # a list written as text (Flower's run config)
        import yaml

        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ValueError(f"not a list of logger names: {value!r} ({exc})") from None
    if not isinstance(value, str | list | tuple):
        raise ValueError(f"a list of logger names or a comma-separated string, got {value!r}")
    items = value.split(",") if isinstance(value, str) else list(value)
    names = list(dict.fromkeys(str(n).strip().lower() for n in items if str(n).strip()))
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ValueError(f"unknown logger(s) {unknown}; choose from {', '.join(LOGGERS)}")
    return names


def check_installed(names: Iterable[str]) -> None:
    """Refuse, before any compute, a logger whose package is not installed, naming the extra that installs it."""
    for name in names:
        spec = LOGGERS[name]
        missing = [m for m in spec.modules if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(
                f"log {name!r} needs the package(s) {', '.join(missing)}: pip install 'fedskew[{spec.extra}]' "
                "(or the 'loggers' extra for all three)"
            )


class Loggers:
    """The loggers of one run, each call guarded: a logger that raises warns once (``note`` and
    :func:`warnings.warn`) and is switched off; nothing it does can stop the run. Started lazily, at the first
    finished round, so a run that finishes no round leaves no tracker output."""

    def __init__(
        self,
        names: Iterable[str],
        cfg: Any,
        run_dir: Path,
        group: str,
        ctx: LogContext,
        note: Callable[[str], None],
        hists: Any = None,
    ) -> None:
        self.active: dict[str, RunLogger] = {n: LOGGERS[n].make() for n in names}
        self.cfg, self.run_dir, self.group, self.ctx, self.note, self.hists = cfg, run_dir, group, ctx, note, hists
        self.started = False
        self.failed: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self.active)

    def _call(self, what: str, *args: Any) -> None:
        for name, logger in list(self.active.items()):
            try:
                getattr(logger, what)(*args)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops the run
                del self.active[name]
                self.failed[name] = f"{type(exc).__name__}: {exc}"
                msg = (
                    f"logger {name} failed in {what} ({self.failed[name]}); it is switched off for this run, whose "
                    f"own files and database row are written as always"
                )
                self.note(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
                if what != "close":
                    with contextlib.suppress(Exception):
                        logger.close()

    def _start(self) -> None:
        self.started = True
        with tempfile.TemporaryDirectory() as tmp:
            self.ctx.partition_png = self._bubble(Path(tmp)) if self.ctx.first_round == 1 else None
            self._call("start", self.cfg, self.run_dir, self.group, self.ctx)
            self.ctx.partition_png = None

    def _bubble(self, tmp: Path) -> Path | None:
        if self.hists is None:
            return None
        try:
            from fedskew.results.partition_view import bubble_plot

            title = f"{self.cfg.dataset}: {self.cfg.partition}, {self.cfg.clients} clients, seed {self.cfg.seed}"
            return bubble_plot(self.hists, tmp / "partition.png", title)
        except Exception:  # noqa: BLE001 - the image is a nicety
            return None

    def round(self, result: Any) -> None:
        if not self.active:
            return
        if not self.started:
            self._start()
        self._call("round", result)

    def end(self, summary: dict[str, Any]) -> None:
        if self.active and self.started:
            self._call("end", summary)

    def close(self) -> None:
        if self.active and self.started:
            self._call("close")
        self.active = {}
