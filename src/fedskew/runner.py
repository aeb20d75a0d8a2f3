"""Run one configured experiment end to end: data -> simulation -> run directory + database."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew import __version__
from fedskew.config import RunConfig
from fedskew.data.federated import FederatedData, build_federated
from fedskew.engine.loop import Diverged, RoundResult, Simulation, resolve_model_name
from fedskew.methods import resolve_method
from fedskew.results.store import ResultsDB, RunWriter, client_rows, default_run_dir, summarize_run


@dataclass(frozen=True)
class RunOutcome:
    run_id: str
    run_dir: Path
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    data: FederatedData


def label_table(data: FederatedData) -> dict[str, Any]:
    """Per-client label histograms (train and local test), saved with every run."""
    return {
        "num_classes": data.num_classes,
        "train": data.train_hists.tolist(),
        "test": data.test_hists.tolist(),
        "global_test": np.bincount(data.y_test.cpu().numpy(), minlength=data.num_classes).tolist(),
    }


def headline(cfg: RunConfig, summary: dict[str, Any]) -> dict[str, Any]:
    """The protocol's headline number: PFLlib reports the best round of the sample-weighted accuracy over the
    clients' test splits; FedCAC the best round of the uniform mean over clients of the personalized models'
    accuracy on their test splits (for a method without personalized models: the global model on each client's
    test split); fedskew's own default is the last-N mean of the global model on the global test set."""
    if cfg.protocol == "pfllib":
        key, stat = "global_local_acc", "best"
    elif cfg.protocol == "fedcac":
        key = "personal_acc_mean" if "personal_acc_mean" in summary else "global_local_acc_mean"
        stat = "best"
    else:
        key, stat = "global_acc", "last_n_mean"
    return {"metric": key, "statistic": stat, "value": summary[key][stat]} if key in summary else {}


def run_experiment(
    cfg: RunConfig,
    *,
    overwrite: bool = False,
    on_round: Callable[[RoundResult], None] | None = None,
    on_start: Callable[[Simulation], None] | None = None,
) -> RunOutcome:
    """Build the federation, run every round, write the run directory and (if configured) the database rows."""

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    now = datetime.now(UTC)
    run_id = f"{now:%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
    out_dir = Path(cfg.out) if cfg.out else default_run_dir(cfg, run_id)
    data = build_federated(cfg)
    method = resolve_method(cfg.method, cfg.method_args)
    # record the model `auto` stood for, so that config.yaml re-runs the same experiment
    cfg = cfg.model_copy(update={"model": resolve_model_name(cfg, data, method)})
    sim = Simulation(cfg, data, method)
    writer = RunWriter(out_dir, cfg, overwrite=overwrite)
    rows: list[tuple[int, int, str, float, float, int]] = []
    records: list[dict[str, Any]] = []
    diverged: Diverged | None = None
    try:
        writer.write_file("clients.json", json.dumps(label_table(data)))
        if on_start is not None:
            on_start(sim)
        for rnd in range(1, cfg.rounds + 1):
            try:
                result = sim.round(rnd)
            except Diverged as exc:  # keep the rounds before it, flagged; the caller reports it loudly
                diverged = exc
                break
            records.append(result.record)
            writer.write_round(result.record)
            if result.probe is not None:
                writer.append_line("skew.jsonl", json.dumps(result.probe))
            rows.extend(client_rows(rnd, result.client_scores))
            if on_round is not None:
                on_round(result)
        summary = summarize_run(records, cfg.last_n)
        summary.update(
            {
                "run_id": run_id,
                "method": cfg.method,
                "model": sim.model_name,
                "seed": cfg.seed,
                "wall_time": time.perf_counter() - started,
                "fedskew_version": __version__,
                "created": now.isoformat(timespec="seconds"),
                "diverged": diverged is not None,
                "diverged_round": diverged.round if diverged else None,
                "diverged_reason": diverged.reason if diverged else None,
            }
        )
        summary["headline"] = headline(cfg, summary)
        run_dir = writer.commit(summary)
    except BaseException:
        writer.abort()
        raise
    if cfg.db:
        with ResultsDB(cfg.db) as db:
            db.add_run(run_id, cfg, now.isoformat(timespec="seconds"), summary, records, rows, str(run_dir))
    return RunOutcome(run_id, run_dir, summary, records, data)
