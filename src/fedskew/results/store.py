"""The SQLite results database, and the summary of a run's records (the run directory is ``rundir.py``).

A run's rows are inserted in one transaction, so the database never holds half a run. The database is opened in WAL
mode; an insert that meets a lock retries with back-off, and a run whose insert still fails keeps its complete run
directory, which ``fedskew db import RUN_DIR`` records later.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedskew import __version__
from fedskew.config import RunConfig
from fedskew.protocol import TIMING_KEYS, ClientScores

SUMMARY_KEYS = (
    "global_acc",
    "global_local_acc",
    "global_local_acc_mean",
    "global_local_acc_worst10",
    "personal_acc",
    "personal_acc_mean",
    "personal_acc_worst10",
    "trained_acc",
    "trained_acc_mean",
    "trained_acc_worst10",
    "domain_acc_avg",
    "domain_acc_std",
    # FedProto/FedProc: nearest-prototype accuracy of the global model (engine/evaluate.py client_part_views)
    "proto_acc",
    "proto_domain_acc_avg",
    "proto_domain_acc_std",
    # held-out clients (heldout_clients > 0): the global model, and their client part's adaptation of it
    "heldout_acc",
    "heldout_acc_mean",
    "heldout_acc_worst10",
    "heldout_adapted_acc",
    "heldout_adapted_acc_mean",
    "heldout_adapted_acc_worst10",
    # the validation splits (validation > 0): what the validation-selected statistic selects on (loop.py evaluate)
    "val_global_acc",
    "val_personal_acc",
)
LOWER_IS_BETTER = frozenset({"domain_acc_std", "proto_domain_acc_std"})

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    created TEXT NOT NULL,
    group_key TEXT NOT NULL,
    method TEXT NOT NULL,
    dataset TEXT NOT NULL,
    partition TEXT NOT NULL,
    seed INTEGER NOT NULL,
    rounds INTEGER NOT NULL,
    config TEXT NOT NULL,
    summary TEXT NOT NULL,
    run_dir TEXT,
    version TEXT NOT NULL,
    wall_time REAL NOT NULL,
    diverged_round INTEGER
);
CREATE TABLE IF NOT EXISTS rounds (
    run_id TEXT NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE,
    round INTEGER NOT NULL,
    train_loss REAL,
    global_acc REAL,
    global_local_acc REAL,
    personal_acc REAL,
    metrics TEXT NOT NULL,
    PRIMARY KEY (run_id, round)
);
CREATE TABLE IF NOT EXISTS client_metrics (
    run_id TEXT NOT NULL REFERENCES runs(run_id) ON DELETE CASCADE,
    round INTEGER NOT NULL,
    cid INTEGER NOT NULL,
    view TEXT NOT NULL,
    accuracy REAL NOT NULL,
    loss REAL NOT NULL,
    n_test INTEGER NOT NULL,
    PRIMARY KEY (run_id, round, cid, view)
);
CREATE TABLE IF NOT EXISTS trials (
    study TEXT NOT NULL,
    number INTEGER NOT NULL,
    method TEXT NOT NULL,
    state TEXT NOT NULL,
    value REAL,
    params TEXT NOT NULL,
    run_dirs TEXT NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (study, number)
);
"""


def validation_selected(evaluated: list[dict[str, Any]], key: str) -> tuple[float, int] | None:
    """``key``'s value at the evaluated round whose validation score is best (the earliest on a tie), and that round:
    the round is selected on the clients' validation splits, the value reported on the test data
    (:func:`fedskew.results.evaluation.selection_key` names the validation score of each metric). None without
    validation scores."""
    from fedskew.results.evaluation import selection_key

    sel = selection_key(key)
    rounds = [(r["round"], r[sel], r[key]) for r in evaluated if sel and sel in r and key in r]
    if not rounds:
        return None
    rnd, _, value = max(rounds, key=lambda t: (t[1], -t[0]))
    return float(value), int(rnd)


def summarize_run(records: list[dict[str, Any]], last_n: int) -> dict[str, Any]:
    """Best round and mean/std of the last ``last_n`` evaluated rounds (all of them when fewer), for every accuracy
    key present, per-domain accuracies (``domain_acc/<name>``) included."""
    evaluated = [r for r in records if r.get("evaluated")]
    out: dict[str, Any] = {"rounds": len(records), "evaluated_rounds": len(evaluated), "last_n": last_n}
    # domain skew: every domain's accuracy (``domain_acc/<name>``), in the records' domain order
    per_domain = list(dict.fromkeys(k for r in evaluated for k in r if k.startswith("domain_acc/")))
    for key in (*SUMMARY_KEYS, *per_domain):
        vals = [(r["round"], r[key]) for r in evaluated if key in r]
        if not vals:
            continue
        sign = -1.0 if key in LOWER_IS_BETTER else 1.0
        best_round, best = max(vals, key=lambda t: (sign * t[1], -t[0]))
        tail = np.array([v for _, v in vals[-last_n:]])
        out[key] = {
            "best": best,
            "best_round": best_round,
            "last_n_mean": float(tail.mean()),
            "last_n_std": float(tail.std()),
            "final": vals[-1][1],
        }
        chosen = validation_selected(evaluated, key)
        if chosen is not None:
            out[key]["validation_selected"], out[key]["validation_round"] = chosen

    def mean(key: str) -> float | None:  # None when no round finished (a run that diverged in round 1)
        return float(np.mean([r[key] for r in records])) if records else None

    sampled = [r for r in evaluated if "eval_clients" in r]
    if sampled:  # eval_clients: the per-client views of these rounds scored a seeded sample of the clients
        out["sampled_evaluation"] = {
            "clients": sampled[0]["eval_clients"],
            "rounds": len(sampled),
            "note": "views of per-client models scored on a seeded sample of clients in these evaluated rounds "
            "(every client in the rounds without eval_clients in metrics.jsonl, the last round always)",
        }
    for key in TIMING_KEYS:
        out[f"mean_{key}"] = mean(key)
    out["bytes_up_per_round"] = mean("bytes_up")
    out["bytes_down_per_round"] = mean("bytes_down")
    return out


def default_run_dir(cfg: RunConfig, stamp: str) -> Path:
    """``runs/<stamp>-<method>[_<args>]-<dataset>-<partition>-s<seed>``: ``<args>`` are the method's non-default
    hyper-parameters, filesystem-safe (``--method fedavg -m weights=uniform`` -> ``fedavg_weights-uniform``), at
    most 40 characters (a longer one is cut and ends in a hash of all of them)."""
    import hashlib
    import re

    from fedskew.methods import resolve_method

    tag, limit = "", 40
    if cfg.method_args:
        try:  # compared with the method's own defaults: `-m weights=samples` on fedavg names nothing
            default, given = resolve_method(cfg.method, {}).args, resolve_method(cfg.method, cfg.method_args).args
            args = {k: v for k, v in given.items() if k not in default or default[k] != v}
        except ValueError:  # a composition that needs its arguments to be valid (fedsa+disco): all of them
            args = dict(cfg.method_args)
        tag = "_".join(
            re.sub(r"[^A-Za-z0-9.]+", "-", f"{k}-{json.dumps(v) if isinstance(v, list | dict) else v}").strip("-")
            for k, v in sorted(args.items())
        )
        if len(tag) > limit:
            digest = hashlib.sha1(json.dumps(args, sort_keys=True, default=str).encode()).hexdigest()[:8]
            tag = f"{tag[: limit - 9].rstrip('-_.')}-{digest}"
    safe = cfg.method.replace("+", "_") + (f"_{tag}" if tag else "")
    return Path("runs") / f"{stamp}-{safe}-{cfg.dataset}-{cfg.partition}-s{cfg.seed}"


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


class DatabaseError(RuntimeError):
    """The results database cannot be opened or written; the message says what to do."""


FEDSKEW_TABLES = frozenset({"runs", "rounds", "client_metrics", "trials"})
RUNS_COLUMNS = frozenset({"run_id", "group_key", "method", "config", "summary"})  # what a fedskew runs table holds


def foreign_reason(conn: sqlite3.Connection) -> str | None:
    """Why the database behind ``conn`` is not fedskew's (another application's SQLite file), or ``None``: an empty
    database, or fedskew's tables only (its ``runs`` table with fedskew's columns)."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    other = sorted(t for t in tables - FEDSKEW_TABLES if not t.startswith("sqlite_"))
    if other:
        return f"it holds tables fedskew does not write ({', '.join(other[:5])}{', ...' if len(other) > 5 else ''})"
    if "runs" in tables:
        missing = RUNS_COLUMNS - {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
        if missing:
            return f"its runs table lacks fedskew's columns ({', '.join(sorted(missing))})"
    return None


def check_db_path(path: str | Path) -> None:
    """Before any compute: the database (or the folder it will be created in) must be usable and, when it exists,
    fedskew's own and writable. Creates and changes nothing."""
    p = Path(path)
    if p.exists():
        if not p.is_file():
            raise DatabaseError(f"results database {p} is not a file (choose another --db, or --no-db)")
        if not os.access(p, os.W_OK):
            raise DatabaseError(f"results database {p} is read-only (choose another --db, or --no-db)")
        try:
            conn = sqlite3.connect(f"file:{p}?mode=ro", uri=True, timeout=1.0)
            try:
                conn.execute("PRAGMA schema_version").fetchone()
                reason = foreign_reason(conn)
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise DatabaseError(
                f"results database {p} cannot be opened: {exc} (choose another --db, or --no-db)"
            ) from None
        if reason is not None:
            raise DatabaseError(
                f"{p} is not a fedskew results database: {reason}; fedskew leaves it as it is (choose another --db, "
                "or --no-db)"
            )
        return
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise DatabaseError(
            f"results database {p} cannot be created: {parent} is not a writable directory (choose another --db, "
            "or --no-db)"
        )


BUSY_TIMEOUT = 5.0  # seconds sqlite itself waits for a lock
RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)  # then fedskew retries after these pauses (about 1.5 min in all)


class ResultsDB:
    """The SQLite store of runs, round metrics and per-client metrics."""

    def __init__(
        self, path: str | Path, *, retry_delays: Sequence[float] | None = None, read_only: bool = False
    ) -> None:
        """``read_only``: open an existing database to read it (``fedskew report``): no schema, no journal-mode
        change, nothing written, read-only storage fine. A database that is not fedskew's is refused, unchanged."""
        self.path = Path(path)
        self.retry_delays = tuple(RETRY_DELAYS if retry_delays is None else retry_delays)
        try:
            if read_only:
                self.conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=BUSY_TIMEOUT)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT)
            reason = foreign_reason(self.conn)
        except (OSError, sqlite3.Error) as exc:
            raise DatabaseError(f"results database {self.path} cannot be opened: {exc}") from None
        if reason is not None:
            self.conn.close()
            raise DatabaseError(f"{self.path} is not a fedskew results database: {reason}; fedskew leaves it as it is")
        if read_only:
            if "runs" not in {r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}:
                self.conn.close()
                raise DatabaseError(f"results database {self.path} holds no runs yet")
            return
        try:
            self._retry(lambda: self._setup())
        except (OSError, sqlite3.Error) as exc:
            raise DatabaseError(f"results database {self.path} cannot be opened: {exc}") from None

    def _setup(self) -> None:
        self.conn.execute("PRAGMA journal_mode = WAL")  # readers never block the writer of a run
        self.conn.execute("PRAGMA foreign_keys = ON")
        self.conn.executescript(SCHEMA)
        columns = {row[1] for row in self.conn.execute("PRAGMA table_info(runs)")}
        if "diverged_round" not in columns:  # a database written before divergence was recorded
            with self.conn:
                self.conn.execute("ALTER TABLE runs ADD COLUMN diverged_round INTEGER")

    def _retry(self, action: Callable[[], Any]) -> Any:
        """Run ``action``; on "database is locked"/"busy" wait and retry with back-off (after sqlite's own 5 s)."""
        for delay in (*self.retry_delays, None):
            try:
                return action()
            except sqlite3.OperationalError as exc:
                if delay is None or not any(w in str(exc) for w in ("locked", "busy")):
                    raise
                time.sleep(delay)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> ResultsDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_run(
        self,
        run_id: str,
        cfg: RunConfig,
        created: str,
        summary: dict[str, Any],
        records: list[dict[str, Any]],
        client_rows: Iterable[tuple[int, int, str, float, float, int]],
        run_dir: str | None,
    ) -> None:
        """Insert one finished run with all its rows, atomically (retried while the database is locked)."""
        run_row = (
            run_id,
            created,
            cfg.group_key(),
            cfg.method,
            cfg.dataset,
            cfg.partition,
            cfg.seed,
            cfg.rounds,
            json.dumps(cfg.model_dump(), sort_keys=True),
            json.dumps(summary, sort_keys=True),
            run_dir,
            __version__,
            float(summary.get("wall_time", 0.0)),
            summary.get("diverged_round"),
        )
        round_rows = [
            (
                run_id,
                r["round"],
                _num(r.get("train_loss")),
                _num(r.get("global_acc")),
                _num(r.get("global_local_acc")),
                _num(r.get("personal_acc")),
                json.dumps(r, sort_keys=True),
            )
            for r in records
        ]
        per_client = [(run_id, *row) for row in client_rows]

        def insert() -> None:
            with self.conn:
                self.conn.execute(
                    "INSERT INTO runs (run_id, created, group_key, method, dataset, partition, seed, rounds, config, "
                    "summary, run_dir, version, wall_time, diverged_round) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    run_row,
                )
                self.conn.executemany("INSERT INTO rounds VALUES (?,?,?,?,?,?,?)", round_rows)
                self.conn.executemany("INSERT INTO client_metrics VALUES (?,?,?,?,?,?,?)", per_client)

        self._retry(insert)

    def add_trial(self, row: dict[str, Any]) -> None:
        """A ``fedskew tune`` trial (``fedskew.tuning.study.trial_row``): replaces the row of the same study and
        trial number (a trial is recorded when it ends)."""

        def insert() -> None:
            with self.conn:
                self.conn.execute(
                    "INSERT OR REPLACE INTO trials VALUES (?,?,?,?,?,?,?,?)",
                    (
                        row["study"],
                        row["number"],
                        row["method"],
                        row["state"],
                        _num(row.get("value")),
                        json.dumps(row.get("params", {}), sort_keys=True),
                        json.dumps(row.get("run_dirs", [])),
                        json.dumps(row, sort_keys=True, default=str),
                    ),
                )

        self._retry(insert)

    def trials(self, study: str | None = None) -> list[dict[str, Any]]:
        """The recorded tuning trials (of one study), in study and trial order, as their full records."""
        sql = "SELECT record FROM trials" + (" WHERE study = ?" if study else "") + " ORDER BY study, number"
        return [json.loads(r[0]) for r in self.conn.execute(sql, (study,) if study else ())]

    def has_run(self, run_id: str) -> bool:
        return self.conn.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone() is not None

    def runs(self) -> list[dict[str, Any]]:
        cur = self.conn.execute(
            "SELECT run_id, created, group_key, method, dataset, partition, seed, rounds, config, summary "
            "FROM runs ORDER BY created"
        )
        cols = [d[0] for d in cur.description]
        out = []
        for row in cur.fetchall():
            rec = dict(zip(cols, row, strict=True))
            for key in ("config", "summary"):
                try:
                    rec[key] = json.loads(rec[key])
                except (TypeError, json.JSONDecodeError) as exc:
                    raise DatabaseError(
                        f"results database {self.path}: run {rec['run_id']}'s {key} is not valid JSON ({exc}); "
                        f"remove that run (fedskew db) or rerun it"
                    ) from None
            out.append(rec)
        return out


def client_rows(rnd: int, scores: dict[str, ClientScores]) -> list[tuple[int, int, str, float, float, int]]:
    rows = []
    for view, s in scores.items():
        acc = s.accuracy
        for cid in np.flatnonzero(s.count > 0):
            n = int(s.count[cid])
            rows.append((rnd, int(cid), view, float(acc[cid]), float(s.loss_sum[cid] / n), n))
    return rows
