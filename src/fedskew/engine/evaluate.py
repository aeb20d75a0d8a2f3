"""Evaluation views and their client statistics.

Views recorded each evaluated round (prefix in the metrics record):

* ``global``        the global model on the held-out global test set;
* ``global_local``  the global model on every client's local test split;
* ``personal``      each client's own model on its own local test split, after aggregation (personalized methods);
* ``trained``       each client's model right after its latest local training, on its local test split
                    (personalized methods; Fling's ``before_aggregation`` view, ``personal`` is ``after_aggregation``);
* ``domain_acc/*``  with domain skew: the global model on each domain's test split, ``domain_acc_avg`` (AVG) and
                    ``domain_acc_std`` (sample std across domains, STD), the fairness metrics of FedHEAL.

For the per-client views the record holds the sample-weighted accuracy (``_acc``: total correct / total test samples,
PFLlib's headline), the unweighted mean over clients (``_acc_mean``), the std across clients (``_acc_std``,
population std), and the worst-10% accuracy (``_acc_worst10``: the mean accuracy of the ceil(10%) lowest clients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class ClientScores:
    correct: np.ndarray  # [N]
    loss_sum: np.ndarray  # [N]
    count: np.ndarray  # [N]

    @property
    def accuracy(self) -> np.ndarray:
        return np.divide(self.correct, self.count, out=np.zeros(len(self.count)), where=self.count > 0)


@torch.no_grad()
def predict_scores(
    model: nn.Module, x: Tensor, y: Tensor, owner: Tensor, num_owners: int, batch_size: int
) -> ClientScores:
    """Correct predictions and summed loss per owner (client) in one pass of large batches."""
    model.eval()
    correct = torch.zeros(num_owners, dtype=torch.float64, device=x.device)
    loss_sum = torch.zeros(num_owners, dtype=torch.float64, device=x.device)
    for i in range(0, x.shape[0], batch_size):
        xb, yb, ob = x[i : i + batch_size], y[i : i + batch_size], owner[i : i + batch_size]
        logits = model(xb)
        losses = F.cross_entropy(logits, yb, reduction="none").double()
        hits = (logits.argmax(1) == yb).double()
        correct.index_add_(0, ob, hits)
        loss_sum.index_add_(0, ob, losses)
    count = torch.bincount(owner, minlength=num_owners).double()
    return ClientScores(correct.cpu().numpy(), loss_sum.cpu().numpy(), count.cpu().numpy())


def summarize(prefix: str, s: ClientScores) -> dict[str, float]:
    """Sample-weighted and unweighted client statistics of one view."""
    has = s.count > 0
    acc = s.accuracy[has]
    total = s.count.sum()
    worst_k = max(1, math.ceil(0.1 * len(acc)))
    return {
        f"{prefix}_acc": float(s.correct.sum() / total),
        f"{prefix}_loss": float(s.loss_sum.sum() / total),
        f"{prefix}_acc_mean": float(acc.mean()),
        f"{prefix}_acc_std": float(acc.std()),
        f"{prefix}_acc_worst10": float(np.sort(acc)[:worst_k].mean()),
    }


def domain_summary(domains: tuple[str, ...], s: ClientScores) -> dict[str, float]:
    """Per-domain accuracy of the global model, their mean (AVG) and sample std (ddof=1, STD), as FedHEAL reports."""
    acc = s.accuracy
    out = {f"domain_acc/{name}": float(a) for name, a in zip(domains, acc, strict=True)}
    out["domain_acc_avg"] = float(acc.mean())
    out["domain_acc_std"] = float(acc.std(ddof=1)) if len(acc) > 1 else 0.0
    return out


def evaluate_global(model: nn.Module, x: Tensor, y: Tensor, batch_size: int) -> dict[str, float]:
    owner = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    s = predict_scores(model, x, y, owner, 1, batch_size)
    return {"global_acc": float(s.correct[0] / s.count[0]), "global_loss": float(s.loss_sum[0] / s.count[0])}
