"""The papers ``fedskew reproduce`` knows: their tables, settings and published numbers, as validated data.

Each paper is one YAML file in ``papers/`` (shipped with the package). Its numbers are copied from the implementation
spec (``specs/methods.md``), which transcribes the papers' tables; every table names its source (paper, table,
setting). A file describes:

* ``settings``: the paper's data settings (dataset + partition keys), and offline *stand-ins* (``stands_for``: the
  paper's partition on a dataset shipped offline, compared with the paper's number of the setting it stands for);
* ``rows``: the methods of the tables as fedskew compositions with their hyper-parameters;
* ``scales``: ``paper`` (the paper's rounds, epochs, clients, model), ``small`` (a stated reduction, about an hour
  on one GPU), ``cpu`` (the paper's protocol on MNIST / Fashion-MNIST with their official test sets and 5 seeds,
  1 to 1.5 hours per paper on 2 cores, fedsa 2.5: sized to resolve differences, issue 23), ``laptop`` (the paper's
  protocol on the embedded 8x8 digits, 6 to 17 minutes per paper on 2 cores, offline) and ``smoke`` (a pipeline check);
* ``tables``: columns (a setting, and a metric when the columns are metrics of one setting) and the paper's values.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from fedskew.schema import ConfigError, StrictSettings, describe_errors

PAPER_DIR = Path(__file__).parent / "papers"
SCALES = ("smoke", "laptop", "cpu", "small", "paper")
Scale = Literal["smoke", "laptop", "cpu", "small", "paper"]


class Source(StrictSettings):
    paper: str
    table: str
    setting: str = ""


class Metric(StrictSettings):
    keys: list[str] = Field(min_length=1, description="summary metrics; a run's first one present is used")
    statistic: Literal["best", "last_n_mean", "final"]
    description: str = ""


class Setting(StrictSettings):
    label: str
    dataset: str
    config: dict[str, Any] = Field(default_factory=dict, description="configuration keys at every scale")
    paper_config: dict[str, Any] = Field(default_factory=dict, description="configuration keys at scale paper")
    stands_for: str | None = Field(None, description="the paper setting whose numbers an offline stand-in is beside")
    scales: list[Scale] = Field(default_factory=lambda: ["small", "paper"])
    clients_per_domain: int | None = Field(None, ge=1, description="domain skew: clients = this x domains present")
    train_samples: int | None = Field(None, ge=1, description="the paper's training samples per run (compute)")
    train_samples_note: str = ""


class Row(StrictSettings):
    id: str
    label: str
    method: str
    args: dict[str, Any] = Field(default_factory=dict)
    metric: list[str] | None = Field(None, description="this row's metrics, first present wins (else the table's)")
    scale_args: dict[Scale, dict[str, Any]] = Field(
        default_factory=dict, description="arguments changed at one scale (a cheaper smoke), over args"
    )
    config: dict[str, Any] = Field(
        default_factory=dict, description="run settings the row's method needs (FedFomo: a validation split)"
    )


class Column(StrictSettings):
    id: str | None = None
    setting: str
    metric: str | None = None
    label: str | None = None
    lower_is_better: bool = False


class Table(StrictSettings):
    id: str
    title: str
    source: Source
    columns: list[str | Column]
    values: dict[str, dict[str, str | float]]
    pairs: list[tuple[str, str]] = Field(
        default_factory=list, description="(host row, host+plug-in row): the plug-in's gain is compared per column"
    )
    statistic: Literal["best", "last_n_mean", "final"] | None = Field(
        None, description="which round this table's published numbers are, when not the paper metric's statistic"
    )
    statistic_note: str = Field("", description="how the source states its statistic (shown under the table)")

    def column_list(self) -> list[Column]:
        return [Column(id=c, setting=c) if isinstance(c, str) else c for c in self.columns]


class ScaleSpec(StrictSettings):
    config: dict[str, Any]
    seeds: list[int] = Field(min_length=1)
    note: str


class Paper(StrictSettings):
    paper: str
    aliases: list[str] = Field(default_factory=list)
    title: str
    source: str
    metric: Metric
    common: dict[str, Any] = Field(default_factory=dict)
    paper_setup: dict[str, Any]
    scales: dict[Scale, ScaleSpec]
    settings: dict[str, Setting]
    rows: list[Row]
    notes: list[str] = Field(default_factory=list)
    verdicts: bool = Field(False, description="a verdict per cell: does the published number lie within our spread")
    tables: list[Table]

    @model_validator(mode="after")
    def _consistent(self) -> Paper:
        missing = [s for s in SCALES if s not in self.scales]
        if missing:
            raise ValueError(f"scales {missing} are missing")
        rows = {r.id for r in self.rows}
        if len(rows) != len(self.rows):
            raise ValueError("row ids must be distinct")
        for sid, s in self.settings.items():
            if s.stands_for is not None and s.stands_for not in self.settings:
                raise ValueError(f"setting {sid!r} stands for unknown setting {s.stands_for!r}")
        for t in self.tables:
            cols = t.column_list()
            ids = [c.id for c in cols]
            if len(set(ids)) != len(ids):
                raise ValueError(f"table {t.id!r}: column ids must be distinct")
            for c in cols:
                if c.setting not in self.settings:
                    raise ValueError(f"table {t.id!r}: column {c.id!r} names unknown setting {c.setting!r}")
            for rid, vals in t.values.items():
                if rid not in rows:
                    raise ValueError(f"table {t.id!r}: values for unknown row {rid!r}")
                bad = [k for k in vals if k not in ids]
                if bad:
                    raise ValueError(f"table {t.id!r}, row {rid!r}: values for unknown column(s) {bad}")
                for k, v in vals.items():
                    parse_value(v, f"table {t.id!r}, row {rid!r}, column {k!r}")
            bad_pairs = [p for p in t.pairs if p[0] not in t.values or p[1] not in t.values]
            if bad_pairs:
                raise ValueError(f"table {t.id!r}: pairs {bad_pairs} name rows without values in it")
        return self

    def row(self, rid: str) -> Row:
        return next(r for r in self.rows if r.id == rid)

    def table_rows(self, table: Table) -> list[Row]:
        """The rows of a table: every row with a paper value in it, in the paper's row order."""
        return [r for r in self.rows if r.id in table.values]


_VALUE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(?:(?:±|\+-|\+/-)\s*(\d+(?:\.\d+)?))?\s*$")


def parse_value(v: str | float, where: str = "") -> tuple[float, float | None]:
    """A published number ``"90.79±0.08"`` (or ``90.79``) as (mean, std or None), in %."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v), None
    m = _VALUE.match(str(v))
    if not m:
        raise ValueError(f"{where}: {v!r} is not a number or 'mean±std'")
    return float(m.group(1)), (float(m.group(2)) if m.group(2) else None)


def paper_names() -> list[str]:
    return sorted(p.stem for p in PAPER_DIR.glob("*.yaml"))


@cache
def _aliases() -> dict[str, str]:
    out = {}
    for name in paper_names():
        for alias in yaml.safe_load((PAPER_DIR / f"{name}.yaml").read_text()).get("aliases") or []:
            out[alias] = name
    return out


def load_paper(name: str) -> Paper:
    """The paper ``name`` (``fedsa``, ``feddisco``, ``fedcac``, ``fedheal``, or an alias such as ``fedpake``)."""
    key = _aliases().get(name.strip().lower(), name.strip().lower())
    path = PAPER_DIR / f"{key}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown paper {name!r}; choose one of {', '.join(paper_names())}")
    try:
        return Paper(**yaml.safe_load(path.read_text()))
    except ValidationError as exc:
        raise ConfigError(f"paper data {path}:\n  " + "\n  ".join(describe_errors(exc, Paper))) from None
