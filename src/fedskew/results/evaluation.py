"""Which number a table reports, as one named record: :class:`Evaluation`.

A federated result is only comparable when its evaluation protocol is known: which **round** (the final one, the best
one, the mean of the last N, or the one selected on a validation split), which **clients** (all of them, a sample,
or held-out clients that never trained), which **model** (the global one or the clients' personalized ones), scored
on which **data** and averaged how (**mean**: pooled over samples, sample-weighted over clients, uniform over
clients or over domains). PFLlib #226/#35/#78 and FL-bench #139/#204 are users asking exactly this. Every summary
fedskew writes stores the record of its headline (``summary.json`` -> ``evaluation``), and every table it prints
(``fedskew run``, ``report``, ``sweep``, ``reproduce``) states it in its header.

The record is derived from the metric's name (:data:`METRICS`, the keys of :data:`fedskew.results.store.SUMMARY_KEYS`)
and the statistic, plus the run settings that change what a view scores (``eval_clients``, ``evaluate_on``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# metric prefix -> (model, data, clients); the suffix says the mean
_VIEWS: dict[str, tuple[str, str]] = {
    "global": ("global model", "the global test set"),
    "global_local": ("global model", "each client's test split"),
    "personal": ("personalized models (after aggregation)", "each client's test split"),
    "trained": ("personalized models (after local training)", "each client's test split"),
    "heldout": ("global model", "each held-out client's test split (clients that never trained)"),
    "heldout_adapted": (
        "the global model adapted by each held-out client (its local fine-tuning)",
        "each held-out client's test split",
    ),
    "domain": ("global model", "each domain's test split"),
    "proto": ("global model's nearest prototype", "the global test set"),
    "proto_domain": ("global model's nearest prototype", "each domain's test split"),
    "val_global": ("global model", "the union of the clients' validation splits"),
    "val_personal": ("personalized models (after aggregation)", "each client's validation split"),
}
_MEANS = {
    "acc": "pooled over the samples (sample-weighted over clients)",
    "acc_mean": "uniform over clients",
    "acc_worst10": "mean of the worst 10% of clients",
    "acc_avg": "uniform over domains",
    "acc_std": "std across domains (lower is better)",
}
STATISTICS = {
    "final": "the final round",
    "best": "the best evaluated round (selected on the data it reports: optimistic)",
    "last_n_mean": "the mean of the last {n} evaluated rounds",
    "validation_selected": "the round with the best validation score (selected on the validation split, reported "
    "on the test data)",
}


@dataclass(frozen=True)
class Evaluation:
    """One reported number's evaluation protocol."""

    metric: str
    statistic: str
    round: str
    clients: str
    model: str
    data: str
    mean: str

    def line(self) -> str:
        """``global_acc, the final round: global model on the global test set, pooled ..., all clients``."""
        return f"{self.metric}, {self.round}: {self.model} on {self.data}, {self.mean}; clients: {self.clients}"

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def selection_key(metric: str) -> str | None:
    """The validation score that selects the round of ``metric``'s validation-selected statistic: the personalized
    models' pooled validation accuracy for the personalized views, the global model's for every other view; None for
    the validation scores themselves."""
    if metric.startswith("val_"):
        return None
    return "val_personal_acc" if metric.startswith(("personal_", "trained_")) else "val_global_acc"


def _split(metric: str) -> tuple[str, str]:
    if metric.startswith("domain_acc/"):
        return "domain", "acc"
    for suffix in ("acc_worst10", "acc_mean", "acc_avg", "acc_std", "acc"):
        if metric.endswith("_" + suffix):
            return metric[: -len(suffix) - 1], suffix
    raise ValueError(f"no evaluation protocol known for metric {metric!r}")


def describe(
    metric: str,
    statistic: str,
    *,
    last_n: int | None = None,
    eval_clients: int | None = None,
    evaluate_on: str = "test",
    heldout_clients: int = 0,
) -> Evaluation:
    """The protocol of ``metric`` (a summary key, e.g. ``global_local_acc_mean``) reported as ``statistic``
    (``final``, ``best``, ``last_n_mean`` with ``last_n``, ``validation_selected``). ``eval_clients``: the
    per-client views scored a seeded sample of that many clients; ``evaluate_on``: ``validation`` when every view
    scored the clients' validation splits (``fedskew tune``); ``heldout_clients``: clients kept out of training."""
    prefix, suffix = _split(metric)
    if prefix not in _VIEWS or suffix not in _MEANS:
        raise ValueError(f"no evaluation protocol known for metric {metric!r}")
    model, data = _VIEWS[prefix]
    mean = _MEANS[suffix]
    if metric.startswith("domain_acc/"):
        data, mean = f"domain {metric.split('/', 1)[1]}'s test split", "pooled over its samples"
    if prefix in ("global", "proto", "val_global"):
        mean = "pooled over its samples"
    if evaluate_on == "validation":
        data = data.replace("test set", "validation set (the union of the clients' validation splits)").replace(
            "test split", "validation split"
        )
    per_client = data.startswith("each") and "domain" not in data
    if prefix.startswith("heldout"):
        clients = f"the {heldout_clients} held-out clients" if heldout_clients else "the held-out clients"
    elif per_client and prefix in ("personal", "trained") and eval_clients:
        clients = f"a seeded sample of {eval_clients} clients per evaluated round (all in the last round)"
    elif per_client:
        clients = "all clients"
    else:
        clients = "all (one pooled set)"
    if heldout_clients and not prefix.startswith("heldout"):
        clients += f"; the {heldout_clients} held-out clients excluded from training"
    if statistic not in STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; choose one of {', '.join(STATISTICS)}")
    rnd = STATISTICS[statistic].format(n=last_n if last_n else "N")
    return Evaluation(metric, statistic, rnd, clients, model, data, mean)


def of_run(metric: str, statistic: str, cfg: Any, summary: dict[str, Any] | None = None) -> Evaluation:
    """:func:`describe` with a run's settings (a :class:`~fedskew.config.RunConfig` or its dict) and summary."""

    def get(key: str, default: Any = None) -> Any:
        return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)

    summary = summary or {}
    last_n = summary.get("last_n") or get("last_n")
    if last_n and summary.get("evaluated_rounds"):
        last_n = min(int(last_n), int(summary["evaluated_rounds"]))
    sampled = (summary.get("sampled_evaluation") or {}).get("clients") or get("eval_clients")
    return describe(
        metric,
        statistic,
        last_n=last_n,
        eval_clients=sampled if isinstance(sampled, int) else None,
        evaluate_on=get("evaluate_on", "test") or "test",
        heldout_clients=int(get("heldout_clients", 0) or 0),
    )


def statistics_line(statistics: list[str], last_n: int | str | None = None) -> str:
    """What each reported statistic means, for a table's header: ``best = ...; last-N = ...``."""
    names = {"best": "best", "last_n_mean": f"last-{last_n or 'N'}", "final": "final", "validation_selected": "val-sel"}
    return "; ".join(f"{names[s]} = {STATISTICS[s].format(n=last_n or 'N')}" for s in statistics)
