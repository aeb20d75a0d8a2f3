"""Client-side algorithms that change the local objective or exchange extra state.

Each is a handful of hooks on :class:`fedskew.client.local.LocalAlgorithm`; the training loop is never copied, and
any of them composes with any server aggregation (``fedprox+disco``, ``scaffold+heal``, ``moon+fedsa``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.server.api import Params, RoundInput, ServerContext, State


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def proximal(ctx: LocalContext, anchor: Params, mu: float) -> Tensor:
    """``(mu/2)·Σ‖w − anchor‖²`` over the parameters ``ctx.model`` trains now (FedProx, Ditto, FedAMP)."""
    return 0.5 * mu * torch.stack([((p - anchor[n]) ** 2).sum() for n, p in _trainable(ctx.model)]).sum()


@dataclass
class FedProx(LocalAlgorithm):
    """FedProx (Li et al., MLSys 2020): cross-entropy + (mu/2)·||w − w_global||² over trainable parameters.

    Default mu = 0.01 (FedDisco's code default; FedSA/FedPake use 0.001, FedDisco's scripts 0.1).
    mu = 0 is exactly plain local SGD.
    """

    mu: float = 0.01
    name: str = "fedprox"

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        return ce if self.mu == 0 else ce + proximal(ctx, ctx.received, self.mu)


@dataclass
class Moon(LocalAlgorithm):
    """MOON (Li, He, Song, CVPR 2021): cross-entropy + mu · model-contrastive loss on body features.

    The positive pair is (local, global) features, the negative (local, previous local model) features, cosine
    similarity over temperature tau. A client's first participation uses the received global model as its previous
    model (as the official code initializes it). Defaults mu = 1.0, tau = 0.5 (MOON paper's CIFAR-10 settings;
    FedDisco tunes mu, FedSA/FedPake use tau = 1.0).
    """

    mu: float = 1.0
    tau: float = 0.5
    name: str = "moon"
    _frozen: dict[int, tuple[nn.Module, nn.Module]] = field(default_factory=dict, repr=False)

    def _aux(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        # two frozen copies of the architecture, created once per training model (a cache, not state)
        if id(model) not in self._frozen:
            g, p = copy.deepcopy(model), copy.deepcopy(model)
            for m in (g, p):
                m.eval()
                for q in m.parameters():
                    q.requires_grad_(False)
            self._frozen[id(model)] = (g, p)
        return self._frozen[id(model)]

    def begin(self, ctx: LocalContext) -> None:
        glob, prev = self._aux(ctx.model)
        glob.load_state_dict(ctx.received)
        prev.load_state_dict(ctx.client_state.get("moon_prev", ctx.received))

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        if self.mu == 0:
            return ce
        glob, prev = self._aux(ctx.model)
        with torch.no_grad():
            z_glob = glob.body(x)
            z_prev = prev.body(x)
        pos = F.cosine_similarity(features, z_glob, dim=1) / self.tau
        neg = F.cosine_similarity(features, z_prev, dim=1) / self.tau
        contrastive = -pos + torch.logsumexp(torch.stack([pos, neg], dim=1), dim=1)
        return ce + self.mu * contrastive.mean()

    def end(self, ctx: LocalContext) -> Params:
        ctx.client_state["moon_prev"] = {k: v.detach().clone() for k, v in ctx.model.state_dict().items()}
        return {}


@dataclass
class Scaffold(LocalAlgorithm):
    """SCAFFOLD (Karimireddy et al., ICML 2020), option II control variates, global learning rate 1.

    Client: gradient + (c − c_i) before each step; afterwards c_i⁺ = c_i − c + (w_global − w_local)/(steps · lr),
    upload Δc_i = c_i⁺ − c_i. Server: c ← c + (1/N) Σ_{participants} Δc_i (N = all clients, as in FedDisco's code);
    the model itself is combined by whatever server aggregation the method uses.
    """

    name: str = "scaffold"
    prefix: str = "scaffold_dc/"

    def begin(self, ctx: LocalContext) -> None:
        names = [n for n, _ in _trainable(ctx.model)]
        c_i = ctx.client_state.get("scaffold_ci") or {n: torch.zeros_like(ctx.received[n]) for n in names}
        ctx.client_state["scaffold_ci"] = c_i
        c = {n: ctx.broadcast.get(f"scaffold_c/{n}", torch.zeros_like(ctx.received[n])) for n in names}
        ctx.scratch["scaffold_corr"] = [(p, c[n] - c_i[n]) for n, p in _trainable(ctx.model)]
        ctx.scratch["scaffold_c"] = c

    def after_backward(self, ctx: LocalContext) -> None:
        for p, corr in ctx.scratch["scaffold_corr"]:
            if p.grad is not None:
                p.grad.add_(corr)

    def end(self, ctx: LocalContext) -> Params:
        c, c_i = ctx.scratch["scaffold_c"], ctx.client_state["scaffold_ci"]
        scale = 1.0 / (max(ctx.steps, 1) * ctx.settings.lr)
        extras, new_ci = {}, {}
        for n, p in _trainable(ctx.model):
            new_ci[n] = c_i[n] - c[n] + (ctx.received[n] - p.detach()) * scale
            extras[f"{self.prefix}{n}"] = new_ci[n] - c_i[n]
        ctx.client_state["scaffold_ci"] = new_ci
        return extras

    def server_init(self, ctx: ServerContext) -> State:
        return {"c": {n: torch.zeros_like(ctx.template[n]) for n in ctx.trainable}, "num_clients": ctx.num_clients}

    def broadcast(self, state: State) -> Params:
        return {f"scaffold_c/{n}": t for n, t in state["c"].items()}

    def server_update(self, rin: RoundInput, state: State) -> State:
        n_all = state["num_clients"]
        c = {n: t + rin.extras[f"{self.prefix}{n}"].sum(0) / n_all for n, t in state["c"].items()}
        return {"c": c, "num_clients": n_all}
