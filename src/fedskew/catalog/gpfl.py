"""GPFL (Zhang et al., ICCV 2023), whole: a conditional valve turns each feature into a global one, aligned with
class embeddings shared by the federation, and a personal one, read by the client's own head.

The model's classifier is GPFL's composite head (:class:`GPFLHead`, built from the zoo's linear head through
``model_options``): ``valve`` (the CoV: ``γ(c)``, ``β(c)``, each Linear d→d, ReLU, LayerNorm), ``embedding`` (the
GCE: one d-vector ``e_c`` per class) and ``personal`` (the client's head, a Linear, and its two conditional inputs
``p_k``, ``g_k``). With ``CoV(z, c) = ReLU(z ⊙ (γ(c) + 1) + β(c))`` and ``z = body(x)``::

    logits   = personal(CoV(z, p_k))                                    (the personalized model's output)
    f_G      = CoV(z, g_k)
    loss     = CE(logits, y) + CE(cos(f_G, e), y) + λ · ‖f_G − ê_y‖_F    (ê: the received embeddings, frozen; λ=0.01)
               (+ μ/2 ‖θ‖² on the valve and the embeddings: μ = 0.1)
    upload   : body, valve, embedding                                   (averaged by sample count)
    keep     : personal, g_k ← mean_c e_c,  p_k ← Σ_c n_k[c]/n_k · e_c   (the trained embeddings: head.personal.*)

``‖·‖_F`` is the norm of the batch's whole ``[B, d]`` difference (the official code's ``torch.norm(·, 2)``), and
``cos(f_G, e)`` the cosine similarities, unscaled, as logits. The conditional inputs start at zero.

Read against the official code (TsingZ0/GPFL, which PFLlib's ``clientgpfl.py``/``servergpfl.py`` repeat), its
defaults for a 4-layer CNN (``-lam 0.01 -mu 0.1``; ResNet-18 and fastText: ``lam=1e-4, mu=0``). Departures, named: μ
is added to the valve's and the embeddings' gradients before the run's optimizer steps (official: a second plain SGD
with weight decay μ on them; the same at momentum 0, fedskew's default), and the run's own weight decay applies to
them too; the class frequencies count every training sample (official: the samples of its full batches,
``drop_last``); a client that sat out rounds keeps the conditional inputs from its own last training (official: every
client recomputes them from the latest global embeddings each round; the same under full participation).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep, ClientTerm, Padding, StackedTermFn, padded_mean
from fedskew.client.kernels import check_composite_head
from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.models import LinearFrom
from fedskew.protocol import Params
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.space import LogFloat

if TYPE_CHECKING:
    from fedskew.engine.stacked import StackedCall, StackedRun

EMBEDDING = "head.embedding.weight"
SHARED = ("head.valve.", "head.embedding.")  # the entries μ decays


class Valve(nn.Module):
    """GPFL's conditional valve ``CoV(z, c) = ReLU(z ⊙ (γ(c) + 1) + β(c))``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gamma = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.LayerNorm([d]))
        self.beta = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.LayerNorm([d]))

    def forward(self, z: Tensor, c: Tensor) -> Tensor:
        return F.relu(z * (self.gamma(c) + 1) + self.beta(c))

    def stacked_forward(self, s: StackedCall, z: Tensor, c: Tensor) -> Tensor:
        """The same for K clients (engine/stacked.py): ``z`` ``[K, B, d]``, each client's condition ``c`` ``[K, d]``."""
        c = c.unsqueeze(1)
        return F.relu(z * (s("gamma", c) + 1) + s("beta", c))


class PersonalHead(LinearFrom):
    """The client's own head and its conditional inputs ``p_k``, ``g_k`` (buffers, set after training)."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__(source)
        d, device = source.in_features, source.weight.device
        self.register_buffer("personal_input", torch.zeros(d, device=device))
        self.register_buffer("generic_input", torch.zeros(d, device=device))


class GPFLHead(nn.Module):
    """GPFL's composite classifier (module docstring); its output is the personalized model's logits."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__()
        d = source.in_features
        self.valve = Valve(d).to(source.weight.device)
        self.embedding = nn.Embedding(source.out_features, d, device=source.weight.device)
        self.personal = PersonalHead(source)

    def forward(self, z: Tensor) -> Tensor:
        return self.personal(self.valve(z, self.personal.personal_input))

    def stacked_forward(self, s: StackedCall, z: Tensor) -> Tensor:
        """The same for K clients (engine/stacked.py), each through its own valve, conditional input and head."""
        return s("personal", s("valve", z, s["personal.personal_input"]))

    def generic_features(self, z: Tensor) -> Tensor:
        return self.valve(z, self.personal.generic_input)


def embedding_loss(features: Tensor, y: Tensor, embeddings: Tensor) -> Tensor:
    """The GCE's angle-level loss: cross-entropy of the cosine similarities of ``features`` to the class
    ``embeddings`` (unscaled logits)."""
    return F.cross_entropy(F.linear(F.normalize(features), F.normalize(embeddings)), y)


@functools.cache
def stacked_global_path(lam: float) -> StackedTermFn:
    """:meth:`GPFL.loss`'s terms past the cross-entropy on stacked clients, each client's over its batch's real
    samples: the cross-entropy of the cosines of ``CoV(z, g_k)`` to its trained embeddings, and ``lam ·`` the
    Frobenius norm of their gap to the received embeddings of the labels (one function per ``lam``: the same
    captured graphs every round)."""

    def term(
        run: StackedRun, state: Params, z: Tensor, y: Tensor, x: Tensor, reads: Params, padding: Padding
    ) -> Tensor:
        shared = run("head.valve", z, state["head.personal.generic_input"])  # [K, B, d]
        k, b = y.shape
        cos = torch.matmul(F.normalize(shared, dim=-1), F.normalize(state[EMBEDDING], dim=-1).transpose(1, 2))
        ce = F.cross_entropy(cos.reshape(k * b, -1), y.reshape(-1), reduction="none").view(k, b)
        rows = torch.arange(k, device=y.device).unsqueeze(1)
        gap = shared - reads[EMBEDDING][rows, y]
        if padding is not None:  # a padding sample selected out of the norm
            gap = torch.where(padding[0].unsqueeze(-1) > 0, gap, torch.zeros((), dtype=gap.dtype, device=gap.device))
        return padded_mean(ce, padding) + lam * torch.linalg.vector_norm(gap.flatten(1), dim=1)

    return term


def conditional_inputs(embeddings: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """``(p_k, g_k)``: the embeddings weighted by the client's class frequencies, and their plain mean."""
    freq = counts.to(embeddings.dtype) / counts.sum()
    return freq @ embeddings, embeddings.mean(0)


@dataclass
class GPFLRound:
    """What :meth:`GPFL.begin` prepares: the received class embeddings (frozen), the client's class counts."""

    embeddings: Tensor
    counts: Tensor
    head: GPFLHead
    decayed: list[Tensor]  # the valve's and the embeddings' parameters (μ)


@dataclass
class GPFL(LocalAlgorithm):
    """GPFL's client (module docstring)."""

    lam: float = 0.01
    mu: float = 0.1

    def begin(self, ctx: LocalContext) -> None:
        head = ctx.model.head
        assert isinstance(head, GPFLHead) and ctx.y is not None
        counts = torch.bincount(ctx.y, minlength=head.embedding.num_embeddings)
        decayed = [p for n, p in ctx.model.named_parameters() if n.startswith(SHARED)]
        ctx.prepared = GPFLRound(ctx.received[EMBEDDING].detach().clone(), counts, head, decayed)

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        r = ctx.prep(GPFLRound)
        shared = r.head.generic_features(features)
        loss = F.cross_entropy(logits, y) + embedding_loss(shared, y, r.head.embedding.weight)
        return loss + self.lam * torch.linalg.matrix_norm(shared - r.embeddings[y])

    def after_backward(self, ctx: LocalContext) -> None:
        if self.mu == 0:
            return
        with torch.no_grad():
            for p in ctx.prep(GPFLRound).decayed:
                if p.grad is not None:
                    p.grad.add_(p, alpha=self.mu)

    def end(self, ctx: LocalContext) -> Params:
        r = ctx.prep(GPFLRound)
        with torch.no_grad():
            p, g = conditional_inputs(r.head.embedding.weight, r.counts)
            r.head.personal.personal_input.copy_(p)
            r.head.personal.generic_input.copy_(g)
        return {}

    def check_model(self, template: Params, trainable: frozenset[str]) -> None:
        needed = {EMBEDDING, "head.valve.gamma.0.weight", "head.personal.weight", "head.personal.personal_input"}
        check_composite_head(template, needed, "GPFL", "conditional valve, class embeddings, personal head")

    def batched_step(self) -> BatchedStep:
        lam, mu = float(self.lam), float(self.mu)

        def global_path(model: nn.Module, state: Params, z: Tensor, y: Tensor, x: Tensor, reads: Params) -> Tensor:
            """``loss``'s terms for one client: the global features ``CoV(z, g_k)`` through its trained valve, their
            angle-level loss against its trained embeddings and ``lam ·`` their distance to the received ones."""
            valve = {n.removeprefix("head.valve."): t for n, t in state.items() if n.startswith("head.valve.")}
            shared = torch.func.functional_call(model.head.valve, valve, (z, state["head.personal.generic_input"]))
            loss = embedding_loss(shared, y, state[EMBEDDING])
            return loss + lam * torch.linalg.matrix_norm(shared - reads[EMBEDDING][y])

        def term(ctx: LocalContext) -> ClientTerm:
            return ClientTerm(global_path, reads=(EMBEDDING,), stacked=stacked_global_path(lam))

        return BatchedStep(
            client_term=term, client_term_stacked=True, decay=lambda n: mu if n.startswith(SHARED) else 0.0
        )


# ---- registration ----------------------------------------------------------------------------------------------------
class GPFLParams(StrictSettings):
    lam: float = Field(0.01, ge=0)  # magnitude-level alignment weight (official, 4-layer CNN: 0.01)
    mu: float = Field(0.1, ge=0)  # decay of the valve and the embeddings (official, 4-layer CNN: 0.1)


CLIENTS: dict[str, ClientPart] = {
    "gpfl": ClientPart(
        "gpfl",
        "conditional valve: global features aligned with shared class embeddings, personal ones for the "
        "client's own head (lam=0.01, mu=0.1)",
        "Zhang et al., GPFL: Simultaneously Learning Global and Personalized Feature Information for Personalized "
        "Federated Learning, ICCV 2023",
        GPFLParams,
        lambda p: GPFL(lam=p.lam, mu=p.mu),
        personalized=True,
        model_options=lambda p: {"head_module": GPFLHead},
        local=frozenset({"personal"}),
        # the official scripts' values per model: lam 1e-4 .. 1e-2, mu 0 .. 1
        tunable={"lam": LogFloat(1e-4, 0.1), "mu": LogFloat(1e-3, 1.0)},
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
