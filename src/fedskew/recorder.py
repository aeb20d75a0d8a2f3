"""One run recorder: what a run leaves, however it was run.

``fedskew run`` (:func:`fedskew.runner.run_experiment`, the simulator) and the Flower ServerApp
(:func:`fedskew.flower.server_app.run_on_grid`, a real federation) record a run the same way, through one
:class:`RunRecorder`: the run directory's status, ``config.yaml`` and ``clients.json``; each round's lines
(``metrics.jsonl``, ``client_metrics.jsonl``, ``skew.jsonl``) and the live loggers; on failure, the status (or, when
no round finished, no trace at all); at the end the summary (the records' statistics, the run's identity and the
protocol's headline), ``summary.json`` and the database row. A change to any of these is made once, here.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fedskew import __version__
from fedskew.config import ConfigError, RunConfig, dump_yaml, load_yaml, make_config
from fedskew.protocol import ClientScores
from fedskew.results.loggers import Loggers
from fedskew.results.rundir import RunDirectory
from fedskew.results.store import DatabaseError, ResultsDB, client_rows, summarize_run


class RoundRecord(Protocol):
    """What a recorder reads of a finished round (``fedskew.engine.rounds.RoundResult``)."""

    @property
    def record(self) -> dict[str, Any]: ...
    @property
    def client_scores(self) -> Mapping[str, ClientScores]: ...
    @property
    def probe(self) -> dict[str, Any] | None: ...


def headline(cfg: RunConfig, summary: dict[str, Any]) -> dict[str, Any]:
    """The protocol's headline number: PFLlib reports the best round of the sample-weighted accuracy over the
    clients' test splits; FedCAC the best round of the uniform mean over clients of the personalized models'
    accuracy on their test splits (for a method without personalized models: the global model on each client's
    test split); fedskew's own default is the last-N mean of the global model on the global test set."""
    from fedskew.data.protocols import PROTOCOLS

    protocol = PROTOCOLS[cfg.protocol]
    key, stat = protocol.headline("personal_acc_mean" in summary), protocol.statistic  # personal views: personalized
    if key not in summary:
        return {}
    return {"metric": key, "statistic": stat, "value": summary[key][stat], "protocol": protocol.name}


def evaluation_record(cfg: RunConfig, summary: dict[str, Any]) -> dict[str, Any]:
    """The evaluation protocol of the run's headline (:mod:`fedskew.results.evaluation`): which round, clients,
    model, data and mean; ``{}`` when the run has no headline (no evaluated round)."""
    from fedskew.results.evaluation import of_run

    head = summary.get("headline") or {}
    if not head:
        return {}
    return {"protocol": cfg.protocol, **of_run(head["metric"], head["statistic"], cfg, summary).as_dict()}


def domain_fields(cfg: RunConfig, domains: tuple[str, ...]) -> dict[str, Any]:
    """Summary fields of a domain-skew run: the domains it used and those of its suite whose files were not found
    (``{}`` without domains)."""
    from fedskew.data.readers.domains import DOMAIN_SUITES

    if not domains:
        return {}
    missing = []
    suite = DOMAIN_SUITES.get(cfg.dataset)
    if suite is not None and set(suite.domains) & set(domains):
        missing = [d for d in suite.domains if d not in domains]
    return {"domains": list(domains), "domains_missing": missing}


@dataclass
class RunRecorder:
    """Records one run into ``rd`` (already prepared and locked). ``records``: the rounds recorded so far (a resumed
    run's, read back from its ``metrics.jsonl``); ``loggers``: the live trackers, if any."""

    rd: RunDirectory
    cfg: RunConfig
    run_id: str
    created: str
    records: list[dict[str, Any]] = field(default_factory=list)
    loggers: Loggers | None = None

    @property
    def out_dir(self) -> Path:
        return self.rd.path

    def start(self, clients: Mapping[str, Any], files: Mapping[str, str] | None = None, **status: Any) -> None:
        """A new run: its status (``running``, no round yet; ``status`` adds fields, e.g. the engine), its
        configuration, the clients' label table the run's pieces know, and ``files`` (name -> text)."""
        self.rd.set_status(
            "running", run_id=self.run_id, completed_rounds=0, checkpoint_round=None, rounds=self.cfg.rounds, **status
        )
        self.rd.write_file("config.yaml", dump_yaml(self.cfg))
        self.rd.write_file("clients.json", json.dumps(clients))
        for name, text in (files or {}).items():
            self.rd.write_file(name, text)

    def round(self, result: RoundRecord) -> None:
        """A finished round: its record, its per-client scores, its skew probe, and the live loggers."""
        rnd = result.record["round"]
        self.records.append(result.record)
        self.rd.append_line("metrics.jsonl", json.dumps(result.record, sort_keys=True, allow_nan=True))
        if result.client_scores:
            rows = [list(r[1:]) for r in client_rows(rnd, dict(result.client_scores))]
            self.rd.append_line("client_metrics.jsonl", json.dumps({"round": rnd, "rows": rows}))
        if result.probe is not None:
            self.rd.append_line("skew.jsonl", json.dumps(result.probe))
        if self.loggers is not None:
            self.loggers.round(result)

    def failed(self, exc: BaseException, status: str = "failed") -> bool:
        """The run stopped with ``exc``: with no round recorded it leaves no trace (``True``: the directory is
        discarded); else its status says why and how far it got, and the directory is unlocked."""
        if self.loggers is not None:
            self.loggers.close()
        if not self.records:
            self.rd.discard()
            return True
        self.rd.set_status(status, error=f"{type(exc).__name__}: {exc}", completed_rounds=len(self.records))
        self.rd.unlock()
        return False

    def summary(
        self, *, model: str, wall_time: float, diverged: Any, checkpoints: int = 0, checkpoint_time: float = 0.0
    ) -> dict[str, Any]:
        """The run's summary: its records' statistics and its identity (``diverged``: the ``Diverged`` that ended it,
        or ``None``); a host adds its own fields, then :meth:`finish`."""
        summary = summarize_run(self.records, self.cfg.last_n)
        summary.update(
            {
                "run_id": self.run_id,
                "method": self.cfg.method,
                "model": model,
                "seed": self.cfg.seed,
                "wall_time": wall_time,
                "fedskew_version": __version__,
                "created": self.created,
                "diverged": diverged is not None,
                "diverged_round": diverged.round if diverged else None,
                "diverged_reason": diverged.reason if diverged else None,
                "checkpoints": checkpoints,
                "checkpoint_time": checkpoint_time,
            }
        )
        return summary

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write the summary (with the protocol's headline) and end the run directory (``finished`` or
        ``diverged``)."""
        summary["headline"] = headline(self.cfg, summary)
        where = summary.get("evaluation")  # a deployment's (Flower's) word on where the views were scored
        summary["evaluation"] = evaluation_record(self.cfg, summary) | ({"where": where} if where else {})
        self.rd.finish("diverged" if summary["diverged"] else "finished", summary)
        return summary

    def publish(self, summary: dict[str, Any]) -> None:
        """After :meth:`finish`: the live loggers' end, and the database row (``cfg.db``)."""
        if self.loggers is not None:
            self.loggers.end(summary)
            self.loggers.close()
        if self.cfg.db:
            record_in_db(self.cfg.db, self.out_dir)


class DatabaseWriteError(DatabaseError):
    """The run finished and its directory is complete, but its database rows could not be written."""


def record_in_db(db_path: str | Path, run_dir: str | Path) -> bool:
    """Insert the ended run in ``run_dir`` into the database (``fedskew db import``); ``False`` if it is already
    there. Raises :class:`DatabaseWriteError` saying how to import it later."""
    path = Path(run_dir)
    rd = RunDirectory(path)
    summary_file = path / "summary.json"
    if not summary_file.is_file():
        st = rd.status().get("status", "not a run directory")
        raise DatabaseError(f"{path} holds no ended run (status: {st}); only finished or diverged runs are recorded")
    try:
        summary = json.loads(summary_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatabaseError(f"{summary_file} is damaged ({exc}); the run cannot be recorded from it") from None
    if not isinstance(summary, dict) or not {"run_id", "created"} <= set(summary):
        raise DatabaseError(f"{summary_file} is not a fedskew run summary (it has no run_id and created)")
    try:
        cfg = make_config(load_yaml(path / "config.yaml"))
    except ConfigError as exc:
        raise DatabaseError(f"{path}'s configuration cannot be read: {exc}") from None
    records = rd.read_lines("metrics.jsonl")
    rows = [(line["round"], *row) for line in rd.read_lines("client_metrics.jsonl") for row in line["rows"]]
    try:
        with ResultsDB(db_path) as db:
            if db.has_run(summary["run_id"]):
                return False
            db.add_run(summary["run_id"], cfg, summary["created"], summary, records, rows, str(path))
    except (DatabaseError, OSError, sqlite3.Error) as exc:
        raise DatabaseWriteError(
            f"run {summary['run_id']} finished and {path}/ is complete, but the database {db_path} could not be "
            f"written ({exc}). Record it later with: fedskew db import {path} --db {db_path}"
        ) from None
    return True
