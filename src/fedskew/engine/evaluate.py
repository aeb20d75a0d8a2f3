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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.client.local import LocalAlgorithm, overrides
from fedskew.protocol import ClientScores, Params  # ClientScores: beside the exchange types, the results store reads it

if TYPE_CHECKING:
    from fedskew.data.pools import FederatedData


EVAL_ACTIVATION_BUDGET = 16 * 2**20  # bytes: the largest activation of an evaluation batch stays under this on CPU
EVAL_BATCH_CAP = 2048


@torch.inference_mode()
def eval_batch_of(setting: int | str, model: nn.Module, sample: Tensor) -> int:
    """The evaluation batch of a run: ``eval_batch_size`` itself, or :func:`auto_eval_batch` for ``"auto"``."""
    return auto_eval_batch(model, sample) if setting == "auto" else int(setting)


def auto_eval_batch(model: nn.Module, sample: Tensor) -> int:
    """The evaluation batch for ``eval_batch_size: auto``.

    On CPU: the largest batch whose largest buffer (a layer's output, or a convolution's unfolded input) stays under
    :data:`EVAL_ACTIVATION_BUDGET` (16 MiB), so the allocator reuses its buffers instead of mapping fresh pages every
    batch (glibc serves allocations above its mmap threshold, at most 32 MiB, with new pages: at a batch of 2048 the
    PFLlib CNN spent most of its evaluation time in page faults). On an accelerator: :data:`EVAL_BATCH_CAP`. The
    batch changes no prediction, only the last bits of float32 losses."""
    if sample.device.type != "cpu":
        return EVAL_BATCH_CAP
    largest = 0

    def hook(module: nn.Module, args: object, out: object) -> None:
        nonlocal largest
        if isinstance(out, Tensor):
            largest = max(largest, out.numel() * out.element_size())
            if isinstance(module, nn.Conv2d):  # a CPU convolution unfolds its input: (cin/groups)·k·k per output
                kh, kw = module.kernel_size
                unfold = out.numel() // module.out_channels * (module.in_channels // module.groups) * kh * kw
                largest = max(largest, unfold * out.element_size())

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    was_training = model.training
    try:
        model.eval()
        model(sample[:1])
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return int(max(1, min(EVAL_BATCH_CAP, EVAL_ACTIVATION_BUDGET // max(largest, 1))))


@torch.inference_mode()
def batch_scores(
    model: nn.Module, x: Tensor, y: Tensor, batch_size: int, start: int = 0, stop: int | None = None
) -> list[tuple[Tensor, Tensor]]:
    """Per evaluation batch of samples ``[start, stop)`` (``start`` on a batch boundary): each sample's hit (1.0 or
    0.0) and cross-entropy loss, float64. The batches are those of a pass from sample 0, so any split of a pass into
    ranges (worker processes) computes exactly what the whole pass does."""
    stop = x.shape[0] if stop is None else stop
    if start % batch_size:
        raise ValueError(f"start {start} is not on a batch boundary of {batch_size}")
    model.eval()
    out = []
    for i in range(start, stop, batch_size):
        xb, yb = x[i : min(i + batch_size, stop)], y[i : min(i + batch_size, stop)]
        logits = model(xb)
        losses = F.cross_entropy(logits, yb, reduction="none").double()
        out.append(((logits.argmax(1) == yb).double(), losses))
    return out


def accumulate(batches: list[tuple[Tensor, Tensor]], owner: Tensor, num_owners: int) -> ClientScores:
    """Correct predictions and summed loss per owner from a whole pass's :func:`batch_scores`, added in sample
    order: on the CPU, whatever device scored them (CUDA's ``index_add_`` adds with atomics, in no fixed order, so two
    identical runs' summed losses could differ in their last bits; the per-sample vectors are small)."""
    owner = owner.cpu()
    correct = torch.zeros(num_owners, dtype=torch.float64)
    loss_sum = torch.zeros(num_owners, dtype=torch.float64)
    i = 0
    for hits, losses in batches:
        ob = owner[i : i + hits.shape[0]]
        correct.index_add_(0, ob, hits.cpu())
        loss_sum.index_add_(0, ob, losses.cpu())
        i += hits.shape[0]
    if i != owner.shape[0]:
        raise ValueError(f"scores for {i} samples, owners for {owner.shape[0]}")
    count = torch.bincount(owner, minlength=num_owners).double()
    return ClientScores(correct.numpy(), loss_sum.numpy(), count.numpy())


def predict_scores(
    model: nn.Module, x: Tensor, y: Tensor, owner: Tensor, num_owners: int, batch_size: int
) -> ClientScores:
    """Correct predictions and summed loss per owner (client) in one pass of large batches."""
    return accumulate(batch_scores(model, x, y, batch_size), owner, num_owners)


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


def pooled(prefix: str, s: ClientScores) -> dict[str, float]:
    """Accuracy and loss over all samples of a view, whoever owns them (``global_acc`` from per-domain scores, or
    from the clients' scores when the global test set is the union of their test splits)."""
    total = s.count.sum()
    return {f"{prefix}_acc": float(s.correct.sum() / total), f"{prefix}_loss": float(s.loss_sum.sum() / total)}


def client_part_views(
    algo: LocalAlgorithm, broadcast: Params, model: nn.Module, data: FederatedData, batch_size: int
) -> dict[str, float]:
    """Views a client part adds to the evaluation of the global model already in ``model`` (FedProto's and FedProc's
    nearest-prototype accuracy, ``proto_acc``), from its hook ``eval_views(model, broadcast, x, y, owner, num_owners,
    batch_size)``, which returns per view name ``(correct, loss_sum)`` tensors per owner, on the global test set.
    Owners are the domains under domain skew (the record then also holds ``<view>_domain_acc/<name>``,
    ``<view>_domain_acc_avg``, ``<view>_domain_acc_std``), else the whole set. ``broadcast``: what the client part's
    server half sends this round (FedProto's global prototypes)."""
    if not overrides(algo, "eval_views"):
        return {}
    hook = algo.eval_views
    x, y, domains = data.x_test, data.y_test, data.domains
    if domains:
        assert data.test_domain is not None
        owner, num_owners = data.test_domain, len(domains)
    else:
        owner, num_owners = torch.zeros(x.shape[0], dtype=torch.long, device=x.device), 1
    count = torch.bincount(owner, minlength=num_owners).double().cpu().numpy()
    rec: dict[str, float] = {}
    for view, (correct, loss_sum) in hook(model, broadcast, x, y, owner, num_owners, batch_size).items():
        s = ClientScores(correct.double().cpu().numpy(), loss_sum.double().cpu().numpy(), count)
        rec.update(pooled(view, s))
        if domains:
            rec.update({f"{view}_{k}": v for k, v in domain_summary(domains, s).items()})
    return rec


def same_samples(data: FederatedData) -> bool:
    """Whether the global test set is exactly the clients' local test splits in client order (by source index)."""
    parts = [c.test_index for c in data.clients]
    if data.test_index is None or any(p is None for p in parts):
        return False
    return bool(np.array_equal(np.concatenate(parts), data.test_index))


def global_views(server: Any, global_params: Params) -> dict[str, float]:
    """The server-side views of the global model (loaded into ``server.model``): on the global test set (per domain
    under domain skew, skipped when it is exactly the clients' test splits, scored there), plus the views the
    client part adds (FedProto's nearest-prototype accuracy). ``server``: a host of a round server,
    :class:`~fedskew.engine.loop.Simulation` or a deployment's (Flower's), with ``server`` (its
    :class:`~fedskew.engine.round_server.RoundServer`), ``model``, ``data``, ``eval_batch``, ``method``,
    ``global_is_local_union`` and ``local_names``."""
    data, bs, model = server.data, server.eval_batch, server.model
    model.load_state_dict(global_params)
    rec: dict[str, float] = {}
    # views the client part adds (FedProto's nearest-prototype accuracy); {} for every other method
    broadcast = server.server.broadcast()
    rec.update(client_part_views(server.method.client, broadcast, model, data, bs))
    if data.domains and data.test_domain is not None:  # one pass, per domain; the global numbers pool the domains
        assert data.test_domain is not None
        ds = accumulate(_test_pass(server, global_params), data.test_domain, len(data.domains))
        rec.update(pooled("global", ds))
        rec.update(domain_summary(data.domains, ds))
    elif len(data.y_test) and not (server.global_is_local_union and not server.local_names):
        owner = torch.zeros(data.x_test.shape[0], dtype=torch.long, device=data.x_test.device)
        rec.update(pooled("global", accumulate(_test_pass(server, global_params), owner, 1)))
    return rec


def _test_pass(server: Any, global_params: Params) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global model's batch scores on the global test set: through the server's ``batch_scores_of`` (the
    simulator's worker processes) where it has one, else with ``server.model``, which holds ``global_params``."""
    passes = getattr(server, "batch_scores_of", None)
    if passes is not None:
        return passes([(global_params, "test")])[0]
    return batch_scores(server.model, server.data.x_test, server.data.y_test, server.eval_batch)
