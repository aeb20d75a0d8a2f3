"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma, Guan, AAAI 2023), a FedSA/FedPake baseline: before training, the
received model is blended into the client's previous local model on the top ``layer_idx`` parameter tensors with
element-wise weights learned on a sample of the local data (PFLlib's ``clientala.py`` and ``utils/ALA.py``).

PFLlib (TsingZ0/PFLlib) is the reference for every default, because the FedSA/FedPake experiments ran there (spec
§1.1); the differences are listed in ``docs/methods.md``.
"""

from __future__ import annotations

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

    def batched_step(self) -> BatchedStep:
        # the weight learning runs in begin, per client on its own data and generator, as the sequential loop runs it
        return BatchedStep(start_after_begin=True)

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
