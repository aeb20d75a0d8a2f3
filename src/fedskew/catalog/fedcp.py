"""FedCP (Zhang et al., KDD 2023), whole: a conditional policy network splits each feature into a global and a
personal part, read by a global and a personal head.

The model's classifier is FedCP's composite head (:class:`CPHead`, built from the zoo's linear head through
``model_options``): ``policy`` (the CPN: Linear d→2d, LayerNorm, ReLU), ``generic`` (the global head, a Linear) and
``personal`` (the client's own head, a Linear, and its context vector ``c_k``). For a feature ``z = body(x)``::

    s        = policy(z ⊙ c_k / ‖c_k‖)  viewed [2, d]
    r, 1−r   = softmax over the pair of (s + Gumbel noise) / τ        (τ = 1; the noise in local training only)
    logits   = personal(z ⊙ r) + generic(z ⊙ (1−r))

Local training, one client (the body, the personal head and the policy trained by the run's optimizer; the global
head frozen)::

    loss     = CE(logits, y) + λ · MMD²_rbf(z, body_received(x))         (bandwidths 10, 15, 20, 50; λ = 5)
    upload   : body, policy, generic ← ½ (personal + generic)             (averaged by sample count)
    keep     : personal, c_k ← Σ_rows personal.weight                     (the personal group, head.personal.*)

The personalized model is the global model with the client's ``head.personal.*`` entries, so it is evaluated as a
plain state dict (the personal views).

Read against the official code (TsingZ0/FedCP, which PFLlib's ``clientcp.py``/``servercp.py`` repeat): the same
gate, MMD, frozen global head, half-and-half upload of the global head and context from the personal head's row
sums after training; λ = 5 is the official MNIST script's (PFLlib's default is 1). Departures, named: the Gumbel noise
is drawn from the client's seeded stream, and evaluation uses the noise-free gate ``softmax(s/τ)`` (the official
evaluation draws noise, which makes an accuracy a random variable: fedskew's evaluations are deterministic); every
client starts from one context vector, drawn uniform once with the initial model (official: one uniform draw per
client), and a client that has never trained is evaluated with the global model's entries (the mean of the personal
heads that trained). The official server sends the new global head and policy to the round's participants only,
after their training, while the body goes to every client; fedskew sends the global model at each participation
(the same under full participation, which the official scripts use).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep, ClientTerm, HeadDraw, Padding, StackedTermFn
from fedskew.client.kernels import check_composite_head
from fedskew.client.local import LocalAlgorithm, LocalContext, Phase
from fedskew.models import LinearFrom
from fedskew.protocol import Params
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.space import LogFloat

if TYPE_CHECKING:
    from fedskew.engine.stacked import StackedCall, StackedRun

GENERIC, POLICY = "head.generic.", "head.policy."
RBF_BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # the official code's rbf kernel widths


class PersonalHead(LinearFrom):
    """The client's own head and its context vector ``c_k`` (a buffer: set after training, never trained)."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__(source)
        self.register_buffer("context", torch.rand(1, source.in_features, device=source.weight.device))


class CPHead(nn.Module):
    """FedCP's composite classifier (module docstring); ``noise``: the generator of the Gumbel draws in local
    training (set by :class:`FedCP` for the round; without it, and in eval mode, the gate is noise-free)."""

    def __init__(self, source: nn.Linear, tau: float = 1.0) -> None:
        super().__init__()
        d = source.in_features
        self.policy = nn.Sequential(nn.Linear(d, 2 * d), nn.LayerNorm([2 * d]), nn.ReLU())
        self.generic = LinearFrom(source)
        self.personal = PersonalHead(source)
        self.policy.to(source.weight.device)
        self.tau = tau
        self.noise: torch.Generator | None = None

    def gate(self, z: Tensor, exponential: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The personal and global shares ``(r, 1 − r)`` of each feature of ``z`` ``[B, d]``; ``exponential``: the
        step's ``Exp(1)`` draws ``[B, 2, d]`` given from outside (the batched path), else drawn here in training."""
        context = F.normalize(self.personal.context, p=2, dim=1)
        s = self.policy(z * context).view(z.shape[0], 2, -1)
        if exponential is None and self.training and self.noise is not None:  # drawn from the client's stream
            exponential = draw_exponential(self.noise, s.shape, s.dtype)
        if exponential is not None:  # torch's gumbel_softmax: Gumbel noise −log(Exp(1))
            s = s - exponential.log()
        r = torch.softmax(s / self.tau, dim=1)
        return r[:, 0], r[:, 1]

    def forward(self, z: Tensor, exponential: Tensor | None = None) -> Tensor:
        personal, shared = self.gate(z, exponential)
        return self.personal(z * personal) + self.generic(z * shared)

    def stacked_forward(self, s: StackedCall, z: Tensor, exponential: Tensor | None = None) -> Tensor:
        """The same for K clients (engine/stacked.py): ``z`` ``[K, B, d]``, each through its own context, policy and
        heads; ``exponential``: the step's draws ``[K, B, 2, d]`` (none: the noise-free gate)."""
        k, b = z.shape[0], z.shape[1]
        context = F.normalize(s["personal.context"], p=2, dim=-1)  # [K, 1, d]
        gate = s("policy", z * context).view(k, b, 2, -1)
        if exponential is not None:
            gate = gate - exponential.log()
        r = torch.softmax(gate / self.tau, dim=2)
        return s("personal", z * r[:, :, 0]) + s("generic", z * r[:, :, 1])


def draw_exponential(noise: torch.Generator, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """One training forward's ``Exp(1)`` draws from the client's noise stream (on the stream's device)."""
    return torch.empty(tuple(shape), dtype=dtype, device=noise.device).exponential_(generator=noise)


def mmd_rbf(x: Tensor, y: Tensor, bandwidths: Sequence[float] = RBF_BANDWIDTHS) -> Tensor:
    """The (biased) squared maximum mean discrepancy of samples ``x`` and ``y`` ``[B, d]`` under a sum of RBF kernels
    ``k(a, b) = Σ_σ exp(−‖a − b‖² / (2σ))``: ``mean(K_xx + K_yy − 2 K_xy)``, as the official code computes it."""
    sx, sy = (x * x).sum(1), (y * y).sum(1)  # squared distances without a square root (no NaN gradient at 0)
    dxx = sx[:, None] + sx[None, :] - 2 * x @ x.T
    dyy = sy[:, None] + sy[None, :] - 2 * y @ y.T
    dxy = sx[:, None] + sy[None, :] - 2 * x @ y.T
    total = torch.zeros_like(dxx)
    for a in bandwidths:
        total = total + torch.exp(-0.5 * dxx / a) + torch.exp(-0.5 * dyy / a) - 2 * torch.exp(-0.5 * dxy / a)
    return total.mean()


def padded_mmd_rbf(x: Tensor, y: Tensor, padding: Padding, bandwidths: Sequence[float] = RBF_BANDWIDTHS) -> Tensor:
    """:func:`mmd_rbf` of each client's batch (``x``, ``y`` ``[K, B, d]``) over its real samples (``padding``:
    ``(weights [K, B], counts [K])``, engine/captured.py; ``None``: all): the kernels' mean over the pairs of real
    samples, a pair with a padding sample selected out -> ``[K]``."""
    sx, sy = (x * x).sum(-1), (y * y).sum(-1)
    dxx = sx.unsqueeze(2) + sx.unsqueeze(1) - 2 * torch.matmul(x, x.transpose(1, 2))
    dyy = sy.unsqueeze(2) + sy.unsqueeze(1) - 2 * torch.matmul(y, y.transpose(1, 2))
    dxy = sx.unsqueeze(2) + sy.unsqueeze(1) - 2 * torch.matmul(x, y.transpose(1, 2))
    total = torch.zeros_like(dxx)
    for a in bandwidths:
        total = total + torch.exp(-0.5 * dxx / a) + torch.exp(-0.5 * dyy / a) - 2 * torch.exp(-0.5 * dxy / a)
    if padding is None:
        return total.mean((1, 2))
    weights, counts = padding
    pairs = (weights.unsqueeze(2) * weights.unsqueeze(1)) > 0
    kept = torch.where(pairs, total, torch.zeros((), dtype=total.dtype, device=total.device))
    return kept.sum((1, 2)) / counts.to(total.dtype).square()


@functools.cache
def stacked_mmd(lam: float) -> StackedTermFn:
    """:meth:`FedCP.loss`'s MMD on stacked clients: ``lam ·`` each client's MMD² between its features and the
    received body's on the same batch, over its real samples (the received rows' buffers copied, as ``loss``'s copy
    moves them; one function per ``lam``: the same captured graphs every round)."""

    def term(
        run: StackedRun, state: Params, z: Tensor, y: Tensor, x: Tensor, reads: Params, padding: Padding
    ) -> Tensor:
        body = {n: t.clone() for n, t in reads.items()}
        with torch.no_grad():
            received = run("body", x, state=body)
        return lam * padded_mmd_rbf(z, received, padding)

    return term


@dataclass
class CPRound:
    """What :meth:`FedCP.begin` prepares: the received body (frozen) and the head the round trains."""

    body: Params
    head: CPHead
    noise: torch.Generator  # the client's stream of Gumbel draws this round


@dataclass
class FedCP(LocalAlgorithm):
    """FedCP's client (module docstring): CE of the gated two-head output plus λ·MMD to the received body."""

    lam: float = 5.0

    def begin(self, ctx: LocalContext) -> None:
        head = ctx.model.head
        assert isinstance(head, CPHead) and ctx.generator is not None and ctx.x is not None
        noise = torch.Generator(device=ctx.x.device)
        noise.manual_seed(int(torch.randint(0, 2**62, (1,), generator=ctx.generator)))
        head.noise = noise
        # copies: in training mode a BatchNorm layer's running statistics move with each forward pass
        body = {n.removeprefix("body."): t.clone() for n, t in ctx.received.items() if n.startswith("body.")}
        ctx.prepared = CPRound(body, head, noise)

    def phases(self, ctx: LocalContext) -> list[Phase]:
        return [Phase(ctx.settings.epochs, trains=lambda n: not n.startswith(GENERIC))]

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        loss = F.cross_entropy(logits, y)
        if self.lam == 0:
            return loss
        with torch.no_grad():
            received = torch.func.functional_call(ctx.model.body, ctx.prep(CPRound).body, (x,))
        return loss + self.lam * mmd_rbf(features, received)

    def end(self, ctx: LocalContext) -> Params:
        head = ctx.prep(CPRound).head
        head.noise = None
        with torch.no_grad():
            for name in ("weight", "bias"):
                shared, own = getattr(head.generic, name), getattr(head.personal, name)
                shared.copy_(0.5 * (own + shared))
            head.personal.context.copy_(head.personal.weight.sum(0, keepdim=True))
        return {}

    def check_model(self, template: Params, trainable: frozenset[str]) -> None:
        needed = {f"{GENERIC}weight", f"{POLICY}0.weight", "head.personal.weight", "head.personal.context"}
        check_composite_head(template, needed, "FedCP", "policy, generic and personal heads")

    def batched_step(self) -> BatchedStep:
        lam = float(self.lam)

        def mmd(model: nn.Module, state: Params, z: Tensor, y: Tensor, x: Tensor, reads: Params) -> Tensor:
            """``lam ·`` MMD² between one client's features and the received body's on the same batch (its copy of
            the received buffers moves, as ``loss``'s copy does)."""
            body = {n.removeprefix("body."): t.clone() for n, t in reads.items()}
            with torch.no_grad():
                received = torch.func.functional_call(model.body, body, (x,))
            return lam * mmd_rbf(z, received)

        def term(ctx: LocalContext) -> ClientTerm | None:
            if lam == 0:
                return None
            reads = tuple(n for n in ctx.received if n.startswith("body."))
            return ClientTerm(mmd, reads=reads, stacked=stacked_mmd(lam))

        def draws(ctx: LocalContext) -> HeadDraw:
            r = ctx.prep(CPRound)
            d = r.head.personal.context.shape[1]
            return HeadDraw("exponential", lambda b: draw_exponential(r.noise, (b, 2, d), r.head.personal.weight.dtype))

        return BatchedStep(client_term=term, client_term_stacked=True, head_draw=draws)


# ---- registration ----------------------------------------------------------------------------------------------------
class FedCPParams(StrictSettings):
    lam: float = Field(5.0, ge=0)  # the MMD weight (official MNIST script: 5; PFLlib's default 1)


CLIENTS: dict[str, ClientPart] = {
    "fedcp": ClientPart(
        "fedcp",
        "conditional policy splits features between a personal head (kept) and a global one; "
        "lam * MMD to the received body (lam=5)",
        "Zhang et al., FedCP: Separating Feature Information for Personalized Federated Learning via Conditional "
        "Policy, KDD 2023",
        FedCPParams,
        lambda p: FedCP(lam=p.lam),
        personalized=True,
        model_options=lambda p: {"head_module": CPHead},
        local=frozenset({"personal"}),
        tunable={"lam": LogFloat(0.1, 10.0)},  # around the official 5 and PFLlib's 1
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
