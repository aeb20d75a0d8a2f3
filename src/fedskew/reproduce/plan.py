"""What a reproduction runs here: the paper's settings whose data is present, its methods that this version has, at
one scale, as a :class:`~fedskew.sweep.core.SweepSpec`.

Nothing is dropped silently: a method that is not registered (another engineer may be adding it) is listed as *not
available in this version* and runs as soon as it is registered; a setting whose files are missing, or that this
version cannot run, is listed with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedskew.config import ConfigError, make_config
from fedskew.reproduce.papers import Paper, Row, Setting
from fedskew.sweep.core import MethodEntry, SweepSpec

DIGITS_SUITE = ("mnist", "usps", "svhn")  # files the Digits domain suite reads; "synth" is made from MNIST


@dataclass
class PlannedSetting:
    id: str
    setting: Setting
    case: dict[str, Any]  # the partial configuration of the sweep's case
    represents: str  # the paper setting whose numbers it is compared with (itself, or the one it stands for)
    domains: list[str] = field(default_factory=list)  # domain skew: the domains it will use


@dataclass
class Plan:
    paper: Paper
    scale: str
    base: dict[str, Any]
    seeds: list[int]
    settings: list[PlannedSetting]
    rows: list[Row]
    missing_rows: list[tuple[Row, str]]  # (row, why it does not run)
    missing_settings: list[tuple[str, str]]  # (setting id, why it does not run)
    out: Path
    tuned: str | None = None  # a tuned.yaml of `fedskew tune`: rows take their tuned arguments (explicit ones win)
    log: str | None = None  # live loggers of every run (--log tensorboard,mlflow,wandb); changes nothing computed
    against: str | None = None  # the reference row of the paired differences (id, label or method); None: defaults

    @property
    def db(self) -> Path:
        return self.out / "fedskew.db"

    def spec(self) -> SweepSpec:
        """The plan as a sweep spec (written next to the table; ``fedskew sweep`` re-runs it)."""
        return SweepSpec(
            name=f"reproduce-{self.paper.paper}-{self.scale}",
            base=self.base,
            cases=[s.case for s in self.settings],
            methods=[MethodEntry(name=r.method, args=r.args, label=r.label, config=r.config) for r in self.rows],
            seeds=self.seeds,
            out=str(self.out / "runs"),
            db=str(self.db),
            metrics=list(self.paper.metric.keys),
            tuned=self.tuned,
        )

    def setting_reason(self, sid: str) -> str | None:
        return next((why for s, why in self.missing_settings if s == sid), None)


def _found(name: str, data_dir: str | None) -> tuple[bool, str]:
    """Whether the files of reader dataset ``name`` are in the data directory (found as a run will look for them,
    without decoding anything), and where it looked."""
    from fedskew.data.readers.registry import data_roots, get_spec, locate

    spec = get_spec(name)
    found, searched = locate(spec, data_roots(data_dir))
    return found is not None, ", ".join(str(s) for s in searched[:3]) + (" ..." if len(searched) > 3 else "")


def dataset_status(dataset: str, data_dir: str | None) -> tuple[str | None, list[str]]:
    """(why ``dataset`` cannot run here, or None; the domains it would use, for a domain suite)."""
    from fedskew.config import DOMAIN_DATASETS
    from fedskew.data.readers.registry import find_spec

    if dataset == "digits_domains":
        present = [d for d in DIGITS_SUITE if _found(d, data_dir)[0]]
        domains = present + (["synth"] if "mnist" in present else [])
        if len(domains) < 2:
            return f"the Digits domain suite needs the MNIST files (and USPS or SVHN); not found ({data_dir})", []
        return None, domains
    if dataset == "office_caltech":
        from fedskew.data.readers.office import OFFICE_DOMAINS, office_present

        folders, where = office_present(data_dir)
        if len(folders) < 2:
            lacking = [f"{d}/" for d in OFFICE_DOMAINS if d not in folders]
            return (
                f"the Office-Caltech domain suite needs at least 2 of its 4 domain folders (with class subfolders) in "
                f"an office_caltech folder; missing: {', '.join(lacking)} (searched {where})",
                [],
            )
        return None, list(folders)
    if dataset == "ham10000":
        from fedskew.data.readers.ham10000 import ham_missing

        lacking, where = ham_missing(data_dir)
        if lacking:
            return f"HAM10000 files not found: missing {', '.join(lacking)} (searched {where})", []
        return None, []
    if dataset == "ag_news":
        from fedskew.data.readers.ag_news import ag_news_missing

        lacking, where = ag_news_missing(data_dir)
        if lacking:
            return f"AG News files not found: missing {', '.join(lacking)} (searched {where})", []
        return None, []
    if dataset in DOMAIN_DATASETS:
        return None, []
    spec = find_spec(dataset)
    if spec is None:
        return f"dataset {dataset!r} is not supported by this version of fedskew", []
    if not spec.uses_files:
        return None, []  # bundled (digits): nothing to find
    ok, where = _found(dataset, data_dir)
    return (None if ok else f"dataset {spec.name} not found (searched {where})"), []


def method_status(row: Row) -> str | None:
    """Why a row's method does not run in this version (a part not registered, or arguments it refuses), or None."""
    from fedskew.methods import resolve_method  # registers the built-in parts and the catalogs
    from fedskew.registry import ALIASES, CLIENTS, SERVER_PLUGINS, load_entry_points

    load_entry_points()
    parts = [ALIASES.get(t.strip().lower(), t.strip().lower()) for t in row.method.split("+")]
    missing = [p for p in parts if p not in CLIENTS and p not in SERVER_PLUGINS]
    if missing:
        return f"not available in this version ({', '.join(missing)} not registered)"
    try:
        resolve_method(row.method, row.args)
    except ConfigError as exc:
        return f"not runnable with the paper's arguments: {exc}"
    return None


def _selects(selector: str, row: Row) -> bool:
    """``--rows`` selector: ``=ID`` is that row alone; a bare word is a row id or a method, and a method selects
    every row of it (its controls and variants too, e.g. ``fedavg`` keeps ``fedavg_uniform``)."""
    if selector.startswith("="):
        return row.id == selector[1:]
    return selector in (row.id, row.method)


def _referenced(paper: Paper) -> list[str]:
    """The paper settings its tables' columns use, in table order."""
    return list(dict.fromkeys(c.setting for t in paper.tables for c in t.column_list()))


def make_plan(
    paper: Paper,
    scale: str,
    *,
    out: str | Path | None = None,
    data_dir: str | None = None,
    device: str | None = None,
    seeds: list[int] | None = None,
    rows: list[str] | None = None,
    tuned: str | None = None,
    settings: list[str] | None = None,
) -> Plan:
    """The runs of ``paper``'s tables at ``scale`` that can run here; everything else listed with the reason.
    ``rows``: only these rows (ids such as ``fedavg_disco``, or methods such as ``fedavg+disco``, a method naming
    each of its rows; ``=ID`` names that row alone, e.g. ``=fedprox`` without ``fedprox_mu0001``); ``settings``:
    only these settings (the paper's setting ids, e.g. ``mnist_c1``; a stand-in runs for the setting it stands for)."""
    sc = paper.scales[scale]  # type: ignore[index]
    base: dict[str, Any] = {**paper.common, **sc.config}
    if data_dir:
        base["data_dir"] = str(data_dir)
    if device:
        base["device"] = device
    rows_used = [
        r.model_copy(update={"args": {**r.args, **r.scale_args.get(scale, {})}})  # type: ignore[call-overload]
        for r in paper.rows
        if any(r.id in t.values for t in paper.tables)
    ]
    if rows:
        wanted = [w.strip().lower() for w in rows if w.strip()]
        unknown = [w for w in wanted if not any(_selects(w, r) for r in rows_used)]
        if unknown:
            raise ConfigError(
                f"{paper.paper} has no row {', '.join(map(repr, unknown))}; rows: {', '.join(r.id for r in rows_used)}"
                " (a method selects each of its rows; =ID selects that row alone)"
            )
        rows_used = [r for r in rows_used if any(_selects(w, r) for w in wanted)]
    chosen, missing_rows = [], []
    for r in rows_used:
        why = method_status(r)
        (missing_rows.append((r, why)) if why else chosen.append(r))
    planned: list[PlannedSetting] = []
    missing: list[tuple[str, str]] = []
    referenced = _referenced(paper)
    if settings:
        wanted_s = [w.strip() for w in settings if w.strip()]
        unknown_s = [w for w in wanted_s if w not in referenced]
        if unknown_s:
            raise ConfigError(
                f"{paper.paper} has no setting {', '.join(map(repr, unknown_s))}; settings: {', '.join(referenced)}"
            )
        referenced = [pid for pid in referenced if pid in wanted_s]
    for pid in referenced:
        candidates = [pid] + [sid for sid, s in paper.settings.items() if s.stands_for == pid]
        reps = 0
        for sid in candidates:
            s = paper.settings[sid]
            if scale not in s.scales:
                continue
            why, domains = dataset_status(s.dataset, data_dir)
            case = {"dataset": s.dataset, **s.config, **(s.paper_config if scale == "paper" else {})}
            if s.clients_per_domain and domains:
                case["clients"] = s.clients_per_domain * len(domains)
            if why is None:
                try:
                    make_config({**base, **case, "db": None})
                except ConfigError as exc:
                    why = f"this version cannot run it: {str(exc).splitlines()[-1].strip()}"
            if why is None:
                planned.append(PlannedSetting(sid, s, case, pid, domains))
                reps += 1
            else:
                missing.append((sid, why))
        if not reps and not any(m == pid for m, _ in missing):
            only = ", ".join(paper.settings[pid].scales)
            missing.append((pid, f"not part of scale {scale} (runs at: {only})"))
    root = Path(out) if out else Path("runs") / "reproduce" / f"{paper.paper}-{scale}{'-tuned' if tuned else ''}"
    return Plan(paper, scale, base, list(seeds or sc.seeds), planned, chosen, missing_rows, missing, root, tuned)
