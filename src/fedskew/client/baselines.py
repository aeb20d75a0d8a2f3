"""Client sides of the FedSA/FedPake paper's baselines FedNTD, FedBABU and FedALA, as hooks on the one loop.

* :class:`FedNTD`  cross-entropy + ``beta`` · not-true-class distillation from the received global model.
* :class:`FedBABU` the body is trained with the head frozen at its random initial value (so the global head never
                   changes); each round the client also fine-tunes its locally trained model (PFLlib; or the
                   received model) and keeps that as its personalized model.
* :class:`FedALA`  before training, the received model is blended into the client's previous local model on the top
                   ``layer_idx`` parameter tensors with element-wise weights learned on a sample of the local data.

PFLlib (TsingZ0/PFLlib, ``system/flcore/clients/clientntd.py``, ``clientbabu.py``, ``clientala.py`` and
``system/utils/ALA.py``) is the reference for every default, because the FedSA/FedPake experiments ran there; the
differences are listed in ``docs/methods.md``. FedGen, which also has a server-side part, is in
:mod:`fedskew.client.fedgen`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep, FrozenTermFn
from fedskew.client.local import LocalAlgorithm, LocalContext, Phase, snapshot
from fedskew.client.personal import PERSONAL, is_head
from fedskew.protocol import Params
from fedskew.schema import ConfigError

# ---- FedNTD ---------------------------------------------------------------------------------------------------------


def not_true_logits(logits: Tensor, y: Tensor) -> Tensor:
    """``[B, C]`` logits without each row's true-class column (``[B, C-1]``, the other classes in their order)."""
    keep = torch.ones_like(logits, dtype=torch.bool).scatter_(1, y.view(-1, 1), False)
    return logits[keep].view(logits.shape[0], logits.shape[1] - 1)


def ntd_loss(logits: Tensor, global_logits: Tensor, y: Tensor, tau: float) -> Tensor:
    """FedNTD's not-true distillation (Lee et al. 2022, Eq. 5, with the ``tau²`` scale of the official criterion,
    Lee-Gihun/FedNTD ``algorithms/fedntd/criterion.py``, and of PFLlib's ``clientntd.py``):

    ``tau² · (1/B) Σ_i KL(q_i ‖ p_i)``, ``p_i = softmax(l̃_i/tau)``, ``q_i = softmax(g̃_i/tau)``, where ``l̃_i`` and
    ``g̃_i`` are the local and global model's logits with the true class ``y_i`` removed; ``q`` carries no gradient.
    """
    log_p = F.log_softmax(not_true_logits(logits, y) / tau, dim=1)
    with torch.no_grad():
        q = F.softmax(not_true_logits(global_logits, y) / tau, dim=1)
    return tau**2 * F.kl_div(log_p, q, reduction="batchmean")


def _frozen_copy(cache: dict[int, nn.Module], model: nn.Module) -> nn.Module:
    """A frozen copy of ``model``'s architecture in eval mode, made once per training model (a cache, not state)."""
    if id(model) not in cache:
        teacher = copy.deepcopy(model)
        teacher.eval()
        for q in teacher.parameters():
            q.requires_grad_(False)
        cache[id(model)] = teacher
    return cache[id(model)]


@dataclass
class FedNTD(LocalAlgorithm):
    """FedNTD (Lee et al., NeurIPS 2022): ``CE(l, y) + beta · ntd_loss(l, g, y, tau)`` with ``g`` the logits of the
    received global model (frozen, eval mode) on the same batch. Defaults ``tau = 1``, ``beta = 1`` (the official
    FedNTD config; PFLlib's ``-tau`` default is 1 too, its shared ``-bt`` default 0 would switch the term off).
    ``beta = 0`` is exactly plain local SGD (the global model is not even evaluated)."""

    beta: float = 1.0
    tau: float = 1.0
    name: str = "fedntd"
    _teachers: dict[int, nn.Module] = field(default_factory=dict, repr=False)

    def begin(self, ctx: LocalContext) -> None:
        if self.beta != 0:
            _frozen_copy(self._teachers, ctx.model).load_state_dict(ctx.received)

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        if self.beta == 0:
            return ce
        teacher = _frozen_copy(self._teachers, ctx.model)
        with torch.no_grad():
            global_logits = teacher.head(teacher.body(x))
        return ce + self.beta * ntd_loss(logits, global_logits, y, self.tau)

    def batched_step(self) -> BatchedStep:
        beta, tau = float(self.beta), float(self.tau)

        def term(ctx: LocalContext) -> FrozenTermFn | None:
            """``loss``'s not-true distillation per client: ``beta · ntd_loss`` with the received model's logits, its
            batch mean taken per client."""
            if beta == 0:
                return None

            def distill(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
                k, b, c = logits.shape
                flat_y = y.reshape(k * b)
                log_p = F.log_softmax(not_true_logits(logits.reshape(k * b, c), flat_y) / tau, dim=1)
                q = F.softmax(not_true_logits(outs["received"][1].reshape(k * b, c), flat_y) / tau, dim=1)
                kl = F.kl_div(log_p, q, reduction="none").view(k, b, -1).sum(dim=(1, 2)) / b
                return beta * tau**2 * kl

            return distill

        return BatchedStep(term=term, frozen=("received",))


# ---- FedBABU --------------------------------------------------------------------------------------------------------


BABU_UPLOAD = "fedbabu_upload"  # client_state, within one local_train only: the body-trained model to upload


@dataclass
class FedBABU(LocalAlgorithm):
    """FedBABU (Oh, Kim, Yun, ICLR 2022): federated training updates the body only; the head keeps its random
    initial value (frozen in every client's training, so the aggregated head is the initial one). For evaluation
    a client's model is fine-tuned locally for ``fine_tuning_epochs`` (``fine_tune = "full"``: body and head, as
    PFLlib's default ``fine_tune(['base', 'head'])``; ``"head"``: the head only) and kept as the client's
    personalized model.

    Where the fine-tuning starts (``fine_tune_from``):

    * ``"local"`` (default, PFLlib's ``serverbabu.py``: after the last aggregation every client fine-tunes its own
      ``client.model``, the model right after its latest local training, nothing being sent after the last
      aggregation): phases ``body`` (from the received model, head frozen; kept aside as the upload), then
      ``fine_tune`` continuing from that locally trained model (kept as the personal model); :meth:`end` reloads
      the body-trained model, which is what is uploaded. The personal view after round t is the fine-tuned local
      model of round t (PFLlib's final models when t is the last round, under full participation).
    * ``"global"`` (fedskew's earlier form): phases ``fine_tune`` from the received model (kept as the personal
      model), then ``body`` from the received model again (uploaded); the personal view after round t is the
      fine-tuned global model of round t−1.

    PFLlib fine-tunes once, after the last round; here every participating client fine-tunes in each round (see
    docs/methods.md). ``fine_tune_every = k`` fine-tunes only in rounds divisible by k (the personal model is the
    latest one between): with ``--eval-every k`` the evaluated personal views are the same at a k-th of the cost."""

    fine_tuning_epochs: int = 10
    fine_tune: Literal["full", "head"] = "full"
    fine_tune_every: int = 1
    fine_tune_from: Literal["local", "global"] = "local"
    name: str = "fedbabu"

    def phases(self, ctx: LocalContext) -> list[Phase]:
        body = Phase(ctx.settings.epochs, name="body", start=ctx.received, trains=lambda n: not is_head(n))
        if ctx.round % self.fine_tune_every:
            return [body]
        trains = None if self.fine_tune == "full" else is_head
        if self.fine_tune_from == "global":
            return [Phase(self.fine_tuning_epochs, "fine_tune", start=ctx.received, trains=trains, keep=PERSONAL), body]
        tune = Phase(self.fine_tuning_epochs, "fine_tune", start=None, trains=trains, keep=PERSONAL)  # from the body
        return [replace(body, keep=BABU_UPLOAD), tune]

    def end(self, ctx: LocalContext) -> Params:
        upload = ctx.client_state.pop(BABU_UPLOAD, None)
        if upload is not None:  # fine-tuned after the body phase: upload the body-trained model, not the personal one
            ctx.model.load_state_dict(upload)
        return {}

    def personal_model(self, client_state: dict[str, Any]) -> Params | None:
        return client_state.get(PERSONAL)

    def batched_step(self) -> BatchedStep:
        return BatchedStep()  # phases only (the body with the head frozen, then the fine-tuning)


# ---- FedALA ---------------------------------------------------------------------------------------------------------

ALA_LOCAL = "ala_local"  # client_state: the top tensors of the client's model after its latest training
ALA_WEIGHTS = "ala_weights"  # client_state: the learned element-wise aggregation weights (persist across rounds)
ALA_INIT = "ala_init"  # client_state: the model ALA produced at the client's latest participation (personal view)


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

    eta: float = 1.0
    rand_percent: float = 0.8
    layer_idx: int = 1
    threshold: float = 0.1
    num_pre_loss: int = 10
    max_start_epochs: int = 100
    name: str = "fedala"

    def begin(self, ctx: LocalContext) -> None:
        names = top_parameter_names(ctx.model, self.layer_idx)
        local = ctx.client_state.get(ALA_LOCAL)
        passes = 0
        if names and local is not None:
            assert ctx.x is not None and ctx.y is not None and ctx.generator is not None
            previous = ctx.client_state.get(ALA_WEIGHTS)
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
            ctx.client_state[ALA_WEIGHTS] = weights
            # the received entries everywhere else (weight learning ran in train mode: BN statistics are reset)
            ctx.model.load_state_dict({**ctx.received, **blended})
        ctx.metrics["ala_epochs"] = float(passes)
        ctx.client_state[ALA_INIT] = snapshot(ctx.model)

    def end(self, ctx: LocalContext) -> Params:
        names = top_parameter_names(ctx.model, self.layer_idx)
        if names:
            state = ctx.model.state_dict()
            ctx.client_state[ALA_LOCAL] = {n: state[n].detach().clone() for n in names}
        return {}

    def personal_model(self, client_state: dict[str, Any]) -> Params | None:
        return client_state.get(ALA_INIT)

    def batched_step(self) -> BatchedStep:
        # the weight learning runs in begin, per client on its own data and generator, as the sequential loop runs it
        return BatchedStep(start_after_begin=True)

    def check_model(self, template: Params, trainable: frozenset[str]) -> None:
        if self.layer_idx > len(trainable):
            raise ConfigError(
                f"FedALA: layer_idx={self.layer_idx} exceeds the model's {len(trainable)} trainable parameter tensors"
            )
