"""A search's settings (``fedskew tune`` spec and flags): the base, the methods, the space overrides, the budget and
the objective, validated before anything runs; and the configuration of one trial run, on the validation splits."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from fedskew.config import ConfigError, load_yaml, make_config
from fedskew.schema import StrictSettings, describe_errors
from fedskew.space import RUN_LEVEL, Dist, as_dist
from fedskew.sweep.core import MethodEntry
from fedskew.tuning.method_space import method_space, unknown_overrides

# keys a tune spec's base may not set: the search sets them per trial
_TUNE_OWNED = ("method", "seed", "out", "db", "validation", "evaluate_on")


class TuneSpec(StrictSettings):
    """A search: ``base`` settings, the ``methods`` to tune, the budget and the objective."""

    name: str | None = Field(None, description="the search's name (default: the spec file's name, or 'tune')")
    base: dict[str, Any] = Field(default_factory=dict, description="settings every trial shares (a config file)")
    methods: list[str | MethodEntry] = Field(min_length=1, description="methods to tune (args: fixed, not searched)")
    space: dict[str, Any] = Field(
        default_factory=dict, description="KEY: SPEC overrides of the declared ranges (lr=log:0.001..0.1, mu=none)"
    )
    trials: int = Field(20, ge=1, description="trials per method (a method with nothing to tune runs once)")
    seeds: list[int] | int = Field(default_factory=lambda: [0], description="seeds each trial runs (value: mean)")
    validation: float = Field(0.2, gt=0, lt=1, description="share of every client's training split held out")
    metric: str = Field("auto", description="the objective (auto: the protocol's headline; domain skew: AVG)")
    statistic: Literal["last_n_mean", "best", "final"] = Field("last_n_mean", description="of the metric's curve")
    prune: bool = Field(True, description="stop trials whose validation curve trails the median (after warm-up)")
    warmup_rounds: int | None = Field(None, ge=0, description="rounds before pruning may act (default: rounds/4)")
    storage: str | None = Field(None, description="Optuna storage URL (default sqlite:///OUT/optuna.db)")
    out: str | None = Field(None, description="output folder (default runs/tune-<name>)")
    db: str | None = Field(None, description="results database for the trials table (default OUT/fedskew.db)")
    tuned: str | None = Field(None, description="the tuned.yaml to write or update (default OUT/tuned.yaml)")
    jobs: int = Field(1, ge=1, description="trials at a time, each in its own process")
    timeout: float | None = Field(None, gt=0, description="stop starting trials of a method after this many seconds")

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[int] | int) -> list[int] | int:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"a seed count must be >= 1, got {v}")
        if isinstance(v, list) and (not v or any(s < 0 for s in v) or len(set(v)) != len(v)):
            raise ValueError(f"seeds must be distinct non-negative integers, got {v}")
        return v

    @field_validator("base")
    @classmethod
    def _base(cls, v: dict[str, Any]) -> dict[str, Any]:
        v = {str(k).replace("-", "_"): x for k, x in v.items()}
        owned = [k for k in _TUNE_OWNED if k in v]
        if owned:
            raise ValueError(f"{owned} are set by the search itself (methods:, seeds:, out:, db:, validation:)")
        return v

    def seed_list(self) -> list[int]:
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)

    def method_entries(self) -> list[MethodEntry]:
        return [MethodEntry(name=m) if isinstance(m, str) else m for m in self.methods]

    @property
    def root(self) -> Path:
        return Path(self.out or f"runs/tune-{self.name or 'tune'}")

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.root / 'optuna.db').resolve()}"

    @property
    def db_path(self) -> str:
        return str(self.db or self.root / "fedskew.db")

    @property
    def tuned_path(self) -> Path:
        return Path(self.tuned) if self.tuned else self.root / "tuned.yaml"

    def overrides(self) -> dict[str, Dist | None]:
        return {str(k): as_dist(v) for k, v in self.space.items()}


def load_tune_spec(path: str | Path | None, updates: dict[str, Any] | None = None) -> TuneSpec:
    """A tune spec from a YAML file (or none) with ``updates`` (the command line's flags) on top, validated; every
    method, the base configuration and the space overrides are checked before anything runs."""
    values = load_yaml(path) if path else {}
    for k, v in (updates or {}).items():
        if v is None:
            continue
        if k in ("base", "space"):
            values[k] = {**values.get(k, {}), **v}
        else:
            values[k] = v
    where = f"tune spec {path}" if path else "tune settings"
    try:
        spec = TuneSpec(**values)
    except ValidationError as exc:
        raise ConfigError(f"{where}:\n  " + "\n  ".join(describe_errors(exc, TuneSpec))) from None
    if spec.name is None:
        spec = spec.model_copy(update={"name": Path(path).stem if path else "tune"})
    check_spec(spec)
    return spec


def metric_known(metric: str) -> bool:
    """Whether ``metric`` is one a run's summary can hold (checked before the first trial, not after it)."""
    from fedskew.results.store import SUMMARY_KEYS

    return metric in ("auto", "headline", *SUMMARY_KEYS) or (metric.startswith("domain_acc/") and len(metric) > 11)


def check_spec(spec: TuneSpec) -> None:
    """Every method with its fixed arguments, under the base, is a valid run; the space overrides name keys of some
    method (or run-level settings); the metric is known to the objective."""
    overrides = spec.overrides()
    for entry in spec.method_entries():
        trial_values(spec, entry, {})  # validates the base with this method
        method_space(entry.name, overrides)
    if not metric_known(spec.metric):
        from fedskew.results.store import SUMMARY_KEYS

        raise ConfigError(
            f"metric {spec.metric!r} is not one a run reports; choose auto or one of {', '.join(SUMMARY_KEYS)}, "
            "headline, or domain_acc/<domain>"
        )
    unknown = unknown_overrides([e.name for e in spec.method_entries()], overrides)
    if unknown:
        raise ConfigError(
            f"search space: {unknown} belong to none of the methods {[e.name for e in spec.method_entries()]} "
            f"and are not run-level settings ({', '.join(RUN_LEVEL)})"
        )


def trial_values(spec: TuneSpec, entry: MethodEntry, params: dict[str, Any], seed: int | None = None) -> dict:
    """The configuration of one trial run (validated): base + the trial's arguments, on the validation splits."""
    run = {k: v for k, v in params.items() if k in RUN_LEVEL}
    margs = {**entry.args, **{k: v for k, v in params.items() if k not in RUN_LEVEL}}
    values = {
        **spec.base,
        **run,
        "method": entry.name,
        "method_args": {**spec.base.get("method_args", {}), **margs},
        "validation": spec.validation,
        "evaluate_on": "validation",
        "db": None,
        "seed": spec.seed_list()[0] if seed is None else seed,
    }
    try:
        make_config(values)
    except ConfigError as exc:
        raise ConfigError(f"method {entry.display()}: {exc}") from None
    return values


def objective_metric(spec: TuneSpec, cfg_values: dict[str, Any]) -> tuple[str, str]:
    """(metric, direction): ``auto`` is the protocol's headline metric (PFLlib: the clients' sample-weighted accuracy;
    FedCAC: the personalized models' mean accuracy; fedskew: the global model's accuracy) or, under domain skew, the
    AVG over domains; ``*_std`` and ``*_loss`` metrics are minimized."""
    metric = spec.metric
    if metric == "auto":
        cfg = make_config(cfg_values)
        if cfg.partition == "domain":
            metric = "domain_acc_avg"
        else:
            from fedskew.data.protocols import PROTOCOLS
            from fedskew.methods import resolve_method

            metric = PROTOCOLS[cfg.protocol].headline(resolve_method(cfg.method, cfg.method_args).personalized)
    direction = "minimize" if metric.endswith(("_std", "_loss")) else "maximize"
    return metric, direction


def dump_tune_spec(spec: TuneSpec) -> str:
    import yaml

    data = spec.model_dump(exclude_defaults=True)
    data["methods"] = [m if isinstance(m, str) else m.model_dump(exclude_defaults=True) for m in spec.methods]
    return yaml.safe_dump(data, sort_keys=False)
