"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma, Guan, AAAI 2023), a FedSA/FedPake baseline: before training, the
received model is blended into the client's previous local model on the top ``layer_idx`` parameter tensors with
element-wise weights learned on a sample of the local data (PFLlib's ``clientala.py`` and ``utils/ALA.py``).

PFLlib (TsingZ0/PFLlib) is the reference for every default, because the FedSA/FedPake experiments ran there (spec
§1.1); the differences are listed in ``docs/methods.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep
from fedskew.client.local import LocalAlgorithm, LocalContext, StateKey, snapshot
from fedskew.protocol import Params
from fedskew.registry import NO_GLOBAL_MODEL, ClientPart, ServerPlugin
from fedskew.schema import ConfigError, StrictSettings

# what a client keeps across rounds (client state)
ALA_LOCAL = StateKey[Params]("ala_local", "the top tensors of the client's model after its latest training")
ALA_WEIGHTS = StateKey[Params]("ala_weights", "the learned element-wise aggregation weights")
ALA_INIT = StateKey[Params]("ala_init", "the model ALA produced at the client's latest participation (personal)")


def ala_combine(local: Tensor, received: Tensor, weight: Tensor) -> Tensor:
    """FedALA Eq. 4 on one tensor: ``local + (received − local) ⊙ weight`` (exactly ``received`` where weight = 1,
    exactly ``local`` where weight = 0)."""
    return torch.lerp(local, received, weight)


def ala_weight_step(weight: Tensor, grad: Tensor, local: Tensor, received: Tensor, eta: float) -> Tensor:
    """One step of FedALA's weight learning: ``clip(W − eta · ∇θ L ⊙ (received − local), 0, 1)``, ``∇θ L`` the
    gradient of the loss at the blended parameters (chain rule: ``∂θ/∂W = received − local``)."""
    return torch.clamp(weight - eta * grad * (received - local), 0.0, 1.0)


def top_parameter_names(model: nn.Module, layer_idx: int) -> list[str]:
    """The last ``layer_idx`` trainable parameter tensors, in ``named_parameters`` order (PFLlib's
    ``params[-layer_idx:]``: 1 is the classifier's bias, 2 its weight and bias); 0 gives none."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return names[len(names) - layer_idx :] if layer_idx else []


def learn_ala_weights(
    model: nn.Module,
    received: Params,
    local: Params,
    weights: Params,
    x: Tensor,
    y: Tensor,
    generator: torch.Generator,
    *,
    rand_percent: float,
    batch_size: int,
    eta: float,
    until_converged: bool,
    threshold: float,
    num_pre_loss: int,
    max_epochs: int,
) -> tuple[Params, Params, int]:
    """FedALA's adaptive local aggregation on ``model`` (whose other entries hold the received model): learn the
    weights of the tensors named in ``weights`` on a random contiguous ``rand_percent`` slice of ``(x, y)`` (batches
    in order, as PFLlib's ``DataLoader`` without shuffling), one pass, or, the first time (``until_converged``),
    passes until the standard deviation of the last ``num_pre_loss`` pass losses (each pass's last batch) is below
    ``threshold`` (at most ``max_epochs`` passes). Returns the blended tensors, the new weights and the passes run.
    """
    names = list(weights)
    params = dict(model.named_parameters())
    top = [params[n] for n in names]
    # the body holds the received model throughout when every ALA tensor is in the head: each batch's features are
    # the same in every pass, so they are computed once (the start phase runs up to max_epochs passes; without random
    # layers, whose draws would change, the result is bit-identical to recomputing them)
    reuse = all(n.startswith("head.") for n in names) and not any(
        isinstance(mod, nn.modules.dropout._DropoutNd) for mod in model.body.modules()
    )
    w = {n: weights[n].clone() for n in names}
    n_samples = x.shape[0]
    m = int(rand_percent * n_samples)
    passes = 0
    with torch.no_grad():
        for n in names:
            params[n].copy_(ala_combine(local[n], received[n], w[n]))
    if m > 0:
        start = int(torch.randint(0, n_samples - m + 1, (1,), generator=generator))
        xs, ys = x[start : start + m], y[start : start + m]
        losses: list[float] = []
        features: dict[int, Tensor] = {}
        while True:
            loss = torch.zeros(())
            for b in range(0, m, batch_size):
                if not reuse:
                    z = model.body(xs[b : b + batch_size])
                elif (z := features.get(b)) is None:
                    with torch.no_grad():
                        z = features[b] = model.body(xs[b : b + batch_size])
                loss = F.cross_entropy(model.head(z), ys[b : b + batch_size])
                grads = torch.autograd.grad(loss, top)
                with torch.no_grad():
                    for n, g in zip(names, grads, strict=True):
                        w[n] = ala_weight_step(w[n], g, local[n], received[n], eta)
                        params[n].copy_(ala_combine(local[n], received[n], w[n]))
            losses.append(float(loss.detach()))
            passes += 1
            if not until_converged or passes >= max_epochs:
                break
            if len(losses) > num_pre_loss and float(np.std(losses[-num_pre_loss:])) < threshold:
                break
    return {n: params[n].detach().clone() for n in names}, w, passes


def stacked_weight_learning_applies(model: nn.Module, names: list[str]) -> bool:
    """Whether :func:`learn_ala_weights_stacked` gives what :func:`learn_ala_weights` gives: every ALA tensor in the
    head, and no layer whose training-mode output depends on the batch or on random draws."""
    random_or_batch = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)
    heads = all(n.startswith("head.") for n in names)
    return heads and not any(isinstance(mod, random_or_batch) for mod in model.modules())


@dataclass
class AlaJob:
    """One client's weight learning in :func:`learn_ala_weights_stacked`: its context (received model, data), its
    local top tensors, its weights, the first sample and length of its slice, and whether it learns until the loss
    settles (its first time) or one pass."""

    ctx: LocalContext
    local: Params
    weights: Params
    first: int
    m: int
    until_converged: bool


def learn_ala_weights_stacked(
    model: nn.Module,
    names: list[str],
    jobs: list[AlaJob],
    *,
    batch_size: int,
    eta: float,
    threshold: float,
    num_pre_loss: int,
    max_epochs: int,
) -> list[tuple[Params, Params, int]]:
    """:func:`learn_ala_weights` for several clients at once (where :func:`stacked_weight_learning_applies`): each
    client's slice goes through the body of its received model once (its features are the same in every pass), then
    the clients' heads take their steps together, step ``b`` of every client's pass as one gradient over the stacked
    heads (:func:`_head_step`); a client whose pass has fewer batches is masked out of a step (its weights
    unchanged), and one whose learning has ended leaves the passes. Each client's passes, convergence test and
    results are :func:`learn_ala_weights`'s, to float32 rounding. Returns, per job, its blended tensors, its new
    weights and its passes."""
    k_all = len(jobs)
    tops = [n.removeprefix("head.") for n in names]
    head = model.head
    others = [n for n, _ in head.named_parameters() if n not in tops]
    device = jobs[0].ctx.received[names[0]].device
    local = {t: torch.stack([j.local[n] for j in jobs]) for t, n in zip(tops, names, strict=True)}
    recv = {t: torch.stack([j.ctx.received[n] for j in jobs]) for t, n in zip(tops, names, strict=True)}
    w = {t: torch.stack([j.weights[n] for j in jobs]).clone() for t, n in zip(tops, names, strict=True)}
    fixed = {t: torch.stack([j.ctx.received["head." + t] for j in jobs]) for t in others}
    top = {t: ala_combine(local[t], recv[t], w[t]) for t in tops}
    nbs = [-(-j.m // batch_size) for j in jobs]  # batches in each client's pass
    passes = [0] * k_all
    if max(nbs):
        z_all, y_all, m_all = _padded_features(model, jobs, max(nbs), batch_size)
        step = _head_step(head, tops)
        nb_t = torch.tensor(nbs, device=device)
        active = [j.m > 0 for j in jobs]
        losses: list[list[float]] = [[] for _ in jobs]
        while any(active):
            # this pass's clients only (the others have ended): their rows of everything
            rows = torch.tensor([k for k in range(k_all) if active[k]], device=device)
            lo, re = {t: local[t][rows] for t in tops}, {t: recv[t][rows] for t in tops}
            ws, tp, fx = (
                {t: w[t][rows] for t in tops},
                {t: top[t][rows] for t in tops},
                {t: fixed[t][rows] for t in others},
            )
            nb_r = nb_t[rows]
            last = torch.zeros(len(rows), device=device)
            for b in range(int(nb_r.max())):
                on = b < nb_r
                grads, loss = step(tp, fx, z_all[rows, b], y_all[rows, b], m_all[rows, b])
                with torch.no_grad():
                    for t in tops:
                        keep = on.reshape(-1, *([1] * (ws[t].dim() - 1)))
                        ws[t] = torch.where(keep, ala_weight_step(ws[t], grads[t], lo[t], re[t], eta), ws[t])
                        tp[t] = ala_combine(lo[t], re[t], ws[t])
                    last = torch.where(on & (b == nb_r - 1), loss, last)  # each pass's last batch's loss
            for t in tops:
                w[t][rows], top[t][rows] = ws[t], tp[t]
            for k, loss_k in zip(rows.tolist(), last.tolist(), strict=True):
                losses[k].append(loss_k)
                passes[k] += 1
                settled = len(losses[k]) > num_pre_loss and float(np.std(losses[k][-num_pre_loss:])) < threshold
                active[k] = jobs[k].until_converged and passes[k] < max_epochs and not settled
    return [
        (
            {n: top[t][k].detach().clone() for t, n in zip(tops, names, strict=True)},
            {n: w[t][k].clone() for t, n in zip(tops, names, strict=True)},
            passes[k],
        )
        for k in range(k_all)
    ]


def _head_step(head: nn.Module, tops: list[str]) -> Callable[..., tuple[Params, Tensor]]:
    """One weight-learning step's gradients for stacked clients: ``step(top, fixed, z, y, m)`` with the clients'
    stacked head tensors (``top``: the ALA ones, ``fixed``: the rest), features ``z [K, B, ...]``, labels and a mask
    ``[K, B]`` of the real samples; returns each client's gradient of its batch's mean loss with respect to its
    ``top`` tensors, and the losses ``[K]``. A head of standard layers runs as one plain autograd graph over the
    stacked tensors (``engine/stacked.py``: the gradient of the clients' summed losses with respect to client k's row
    is client k's own); any other head through ``vmap``."""
    from fedskew.engine.stacked import stackable, stacked_forward

    def mean_loss(out: Tensor, y: Tensor, m: Tensor) -> Tensor:
        ce = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none").view(m.shape)
        return (ce * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # the mean over each batch's real samples

    if stackable(head) is None:

        def stacked(top: Params, fixed: Params, z: Tensor, y: Tensor, m: Tensor) -> tuple[Params, Tensor]:
            leaves = {t: v.detach().requires_grad_() for t, v in top.items()}
            per_client = mean_loss(stacked_forward(head, {**leaves, **fixed}, z), y, m)
            grads = torch.autograd.grad(per_client.sum(), [leaves[t] for t in tops])
            return dict(zip(tops, grads, strict=True)), per_client.detach()

        return stacked
    from torch.func import functional_call, grad_and_value, vmap

    def one(top: Params, fixed: Params, z: Tensor, y: Tensor, m: Tensor) -> Tensor:
        return mean_loss(functional_call(head, {**top, **fixed}, (z,)), y, m)

    return vmap(grad_and_value(one))


def _padded_features(
    model: nn.Module, jobs: list[AlaJob], nb_max: int, batch_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Every job's slice through the body of its received model (clients sent the same body share the forward
    passes, in chunks), padded to ``nb_max`` batches: features ``[K, nb_max, batch_size, ...]``, labels and a mask of
    the real samples (``[K, nb_max, batch_size]``)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, j in enumerate(jobs):
        if not j.m:  # nothing to learn on (padded below)
            continue
        body = tuple(v.data_ptr() for n, v in j.ctx.received.items() if not n.startswith("head."))
        groups.setdefault(body, []).append(k)
    slices = [(j.ctx.x[j.first : j.first + j.m], j.ctx.y[j.first : j.first + j.m]) for j in jobs]  # type: ignore[index]
    feats: dict[int, Tensor] = {}
    with torch.no_grad():
        for members in groups.values():
            model.load_state_dict(jobs[members[0]].ctx.received)
            x = torch.cat([slices[k][0] for k in members])
            chunk = 4096 if x.is_cuda else 256  # measured on the CPU: 256 is 1.8x faster than 4096 (cache)
            z = torch.cat([model.body(x[i : i + chunk]) for i in range(0, x.shape[0], chunk)])
            feats.update(zip(members, z.split([jobs[k].m for k in members]), strict=True))
    width = nb_max * batch_size
    some = next(iter(feats.values()))
    for k, j in enumerate(jobs):
        if not j.m:
            feats[k] = some.new_zeros((0, *some.shape[1:]))

    def padded(t: Tensor) -> Tensor:
        return torch.cat([t, t.new_zeros((width - t.shape[0], *t.shape[1:]))])

    z_all = torch.stack([padded(feats[k]) for k in range(len(jobs))])
    y_all = torch.stack([padded(y) for _, y in slices])
    m_all = torch.stack([(torch.arange(width, device=z_all.device) < j.m).to(z_all.dtype) for j in jobs])
    shape = (len(jobs), nb_max, batch_size)
    return z_all.reshape(*shape, *z_all.shape[2:]), y_all.reshape(shape), m_all.reshape(shape)


@dataclass
class FedALA(LocalAlgorithm):
    """FedALA (Zhang et al., AAAI 2023), as PFLlib's ``utils/ALA.py``: at the start of a round the client builds its
    starting model from the received model ``g`` and its previous local model ``l``: every entry is ``g``'s except
    the last ``layer_idx`` parameter tensors, which are ``l + (g − l) ⊙ W`` with element-wise weights ``W ∈ [0, 1]``
    (initialized to 1, kept across rounds) learned by ``eta``-steps on a random ``rand_percent`` slice of the local
    data (until the loss settles at the first time, one pass afterwards). Then ordinary local training.

    A client that has never trained takes the received model (PFLlib: ALA is off while local == global).
    ``layer_idx = 0`` (no ALA layers) or ``rand_percent`` so small that no sample is drawn (weights stay 1) is
    exactly FedAvg. The personal view is the ALA-initialized model of the latest participation (what PFLlib
    evaluates for FedALA). Defaults from PFLlib's ``main.py``/``ALA.py`` (``eta = 1``, ``rand_percent = 80%``,
    ``threshold = 0.1``, ``num_pre_loss = 10``) and the FedSA/FedPake paper (``layer_idx = 1``; PFLlib's default 2).
    ``max_start_epochs`` caps the first weight learning, which PFLlib runs until convergence with no cap."""

    state_keys = (ALA_LOCAL, ALA_WEIGHTS, ALA_INIT)
    eta: float = 1.0
    rand_percent: float = 0.8
    layer_idx: int = 1
    threshold: float = 0.1
    num_pre_loss: int = 10
    max_start_epochs: int = 100
    name: str = "fedala"

    def begin(self, ctx: LocalContext) -> None:
        names = top_parameter_names(ctx.model, self.layer_idx)
        local = ctx.kept(ALA_LOCAL)
        passes = 0
        if names and local is not None:
            assert ctx.x is not None and ctx.y is not None and ctx.generator is not None
            previous = ctx.kept(ALA_WEIGHTS)
            weights = previous or {n: torch.ones_like(ctx.received[n]) for n in names}
            blended, weights, passes = learn_ala_weights(
                ctx.model,
                ctx.received,
                local,
                weights,
                ctx.x,
                ctx.y,
                ctx.generator,
                rand_percent=self.rand_percent,
                batch_size=ctx.settings.batch_size,
                eta=self.eta,
                until_converged=previous is None,
                threshold=self.threshold,
                num_pre_loss=self.num_pre_loss,
                max_epochs=self.max_start_epochs,
            )
            ctx.keep(ALA_WEIGHTS, weights)
            # the received entries everywhere else (weight learning ran in train mode: BN statistics are reset)
            ctx.model.load_state_dict({**ctx.received, **blended})
        ctx.metrics["ala_epochs"] = float(passes)
        ctx.keep(ALA_INIT, snapshot(ctx.model))

    def end(self, ctx: LocalContext) -> Params:
        names = top_parameter_names(ctx.model, self.layer_idx)
        if names:
            state = ctx.model.state_dict()
            ctx.keep(ALA_LOCAL, {n: state[n].detach().clone() for n in names})
        return {}

    def personal_model(self, client_state: dict[str, Any]) -> Params | None:
        return ALA_INIT.get(client_state)

    def begin_all(self, contexts: list[LocalContext]) -> list[Params] | None:
        """Every client's :meth:`begin` at once: the weight learning of the round's clients as one stacked
        computation (:func:`learn_ala_weights_stacked`); ``None`` (each client's ``begin`` then runs in turn) where
        that does not apply: an ALA tensor outside the head, or a layer whose training-mode output depends on the
        batch or on random draws (BatchNorm, dropout), where the features of a client's batches are not fixed."""
        model = contexts[0].model
        names = top_parameter_names(model, self.layer_idx)
        if not stacked_weight_learning_applies(model, names):
            return None
        jobs, learning, starts = [], [], []  # learning: each job's position among the contexts
        for i, ctx in enumerate(contexts):
            local = ctx.kept(ALA_LOCAL)
            start = dict(ctx.received)
            if names and local is not None:
                assert ctx.x is not None and ctx.y is not None and ctx.generator is not None
                previous = ctx.kept(ALA_WEIGHTS)
                weights = previous or {n: torch.ones_like(ctx.received[n]) for n in names}
                m = int(self.rand_percent * ctx.x.shape[0])
                first = int(torch.randint(0, ctx.x.shape[0] - m + 1, (1,), generator=ctx.generator)) if m > 0 else 0
                jobs.append(AlaJob(ctx, local, weights, first, m, until_converged=previous is None))
                learning.append(i)
            else:
                ctx.metrics["ala_epochs"] = 0.0
                ctx.keep(ALA_INIT, {k: v.detach().clone() for k, v in start.items()})
            starts.append(start)
        if jobs:
            learned = learn_ala_weights_stacked(
                model,
                names,
                jobs,
                batch_size=contexts[0].settings.batch_size,
                eta=self.eta,
                threshold=self.threshold,
                num_pre_loss=self.num_pre_loss,
                max_epochs=self.max_start_epochs,
            )
            for i, job, (blended, weights, passes) in zip(learning, jobs, learned, strict=True):
                job.ctx.keep(ALA_WEIGHTS, weights)
                job.ctx.metrics["ala_epochs"] = float(passes)
                start = {**job.ctx.received, **blended}
                job.ctx.keep(ALA_INIT, {k: v.detach().clone() for k, v in start.items()})
                starts[i] = start
        return starts

    def batched_step(self) -> BatchedStep:
        # the weight learning of the round's clients runs stacked (begin_all) where it applies, else in each
        # client's begin on its own data and generator, as the sequential loop runs it
        return BatchedStep(start_after_begin=True, begin_all=self.begin_all)

    def check_model(self, template: Params, trainable: frozenset[str]) -> None:
        if self.layer_idx > len(trainable):
            raise ConfigError(
                f"FedALA: layer_idx={self.layer_idx} exceeds the model's {len(trainable)} trainable parameter tensors"
            )


# ---- registration ----------------------------------------------------------------------------------------------------
class FedALAParams(StrictSettings):
    eta: float = Field(1.0, gt=0)  # PFLlib -et, FedALA paper
    rand_percent: float = Field(0.8, ge=0, le=1)  # PFLlib -s 80 (percent), FedSA/FedPake "0.8"
    layer_idx: int = Field(1, ge=0)  # FedSA/FedPake "higher layers number 1"; PFLlib's default 2; 0: no ALA
    threshold: float = Field(0.1, gt=0)  # PFLlib ALA.py
    num_pre_loss: int = Field(10, ge=1)  # PFLlib ALA.py
    max_start_epochs: int = Field(100, ge=1)  # fedskew's cap on the first weight learning (PFLlib: none)


CLIENTS: dict[str, ClientPart] = {
    "fedala": ClientPart(
        "fedala",
        "adaptive local aggregation of the received model into the previous local one on the top layer_idx=1 "
        "tensors (rand_percent=0.8, eta=1)",
        "Zhang, Hua, Wang, Song, Xue, Ma, Guan, FedALA: Adaptive Local Aggregation for Personalized Federated "
        "Learning, AAAI 2023",
        FedALAParams,
        lambda p: FedALA(**p.model_dump()),
        excludes=(NO_GLOBAL_MODEL,),
        personalized=True,
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
