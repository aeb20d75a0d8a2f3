"""What each client part's local step is on stacked clients: the rules :mod:`fedskew.engine.batched` trains with.

One :class:`BatchedStep` per client part that has a batched step, in :data:`BATCHED_STEPS` (exact types: a subclass
may override any hook), read from the part's own hooks' preparations in ``begin`` (SCAFFOLD's and FedDC's shift,
FedDyn's and FedDC's pull, MOON's previous model) so that nothing is computed twice in two ways; :func:`batchable`
says why a method (on a model) has none. Adding a client part to the batched path means adding its entry here and
an equivalence case to tests/test_batched_clients.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.client.algorithms import FedProx, Moon, Scaffold
from fedskew.client.baselines import FedALA, FedBABU, FedNTD, not_true_logits
from fedskew.client.drift import FedDC, FedDyn
from fedskew.client.fedgen import FedGen
from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.client.loss_before import LossAfter, LossBefore
from fedskew.client.personal import AmpClient, Ditto, FedRep
from fedskew.client.prototypes import FedProc, FedProto, prototypical_contrastive
from fedskew.engine.stacked import FrozenTermFn, HeadTermFn, stackable
from fedskew.models.generator import draw
from fedskew.protocol import FEDGEN_LABELS, Params

if TYPE_CHECKING:
    from fedskew.methods import Method


HOOKS = ("begin", "loss", "after_backward", "after_step", "end", "phases", "personal_model")


@dataclass(frozen=True)
class GeneratedTerm:
    """A loss term on inputs every client draws at every step from its own generator, through its trained head
    (FedGen's ``gen_weight · CE(head(G(ŷ, ε)), ŷ)``). ``draw``: one client's draw for one step (on the CPU; the
    schedule makes the draws in the sequential loop's order: after each epoch's permutation, one per batch);
    ``inputs``: the drawn rows of a step's clients stacked (``[R, ...]``) → what ``term`` reads, computed without
    gradient; ``term``: (the clients' trained head on stacked inputs, those inputs) → the term per client ``[R]``."""

    draw: Callable[[torch.Generator], tuple[Tensor, ...]]
    inputs: Callable[..., Any]
    term: HeadTermFn


@dataclass(frozen=True)
class BatchedStep:
    """How one client part's per-step hooks are computed on stacked clients.

    ``prox_mu``: per phase, the weight of the proximal term ``(mu/2)·Σ‖w − w_received‖²`` over the phase's trained
    parameters added to the cross-entropy (FedProx; Ditto's personal phase; FedAMP's client towards its cloud
    model; ``None`` or 0: none). ``pull``: from the client's context after ``begin``, ``(α_k, anchor, linear)``
    whose gradient ``α_k(θ − anchor) − linear`` is added to the loss's gradient after the backward pass (FedDyn, FedDC:
    ``client.drift.add_pull``; ``linear`` may be ``None``), and ``clip``: the client's total gradient-norm clip applied
    then (0: none; ``clip_grad_norm_``'s formula, per client). ``shift``: the tensors added to its trainable parameters
    after every optimizer step and their scale (SCAFFOLD: ``c − c_i`` and ``−lr``; FedDC: ``c/ω_i − c_i``), or
    ``None`` (for a client part that has none in this configuration too)."""

    prox_mu: Callable[[LocalAlgorithm, str], float] | None = None  # (client part, phase name); None: 0
    shift: Callable[[LocalContext], tuple[list[Tensor], float] | None] | None = None
    pull: Callable[[LocalContext], tuple[float, list[Tensor], list[Tensor] | None]] | None = None
    clip: Callable[[LocalAlgorithm], float] | None = None
    # a loss term against frozen models on the same batch (stacked graph only, engine/stacked.py): the term for the
    # client part (None: off), the frozen models it reads ("received"; "previous": the client's previous model), and
    # per client that previous model (None: the term is absent for the client, as MOON's on a first participation)
    term: Callable[[LocalAlgorithm, LocalContext], FrozenTermFn | None] | None = None
    frozen: tuple[str, ...] = ()
    previous: Callable[[LocalContext], Params | None] | None = None
    # FedProto/FedProc: each client's last-epoch class sums of its features, handed to its own `end` (the prototypes
    # it uploads) in ``ctx.scratch`` as the sequential loop's ``collect`` leaves them
    collect: bool = False
    # FedGen: a term through the trained head on inputs each client draws from its own generator at every step
    generated: Callable[[LocalAlgorithm, LocalContext], GeneratedTerm | None] | None = None
    # FedALA: the client trains from the model its ``begin`` leaves (the received model with its ALA-blended top
    # layers), not from the received model
    start_after_begin: bool = False


def _scaffold_shift(ctx: LocalContext) -> tuple[list[Tensor], float]:
    # what Scaffold.begin prepared for its after_step: (the model's parameters, c − c_i per parameter, −lr)
    _, corr, alpha = ctx.scratch["scaffold_shift"]
    return list(corr), float(alpha)


def _feddyn_pull(ctx: LocalContext) -> tuple[float, list[Tensor], list[Tensor] | None]:
    # what FedDyn.begin prepared for its after_backward: (parameters, received w^t, α_k, g_k per parameter)
    _, anchors, alpha, g = ctx.scratch["feddyn"]
    return float(alpha), list(anchors), list(g)


def _feddc_pull(ctx: LocalContext) -> tuple[float, list[Tensor], list[Tensor] | None]:
    # FedDC.begin: (parameters, w^t − h_i, α_i)
    _, anchors, alpha = ctx.scratch["feddc"]
    return float(alpha), list(anchors), None


def _feddc_shift(ctx: LocalContext) -> tuple[list[Tensor], float] | None:
    # FedDC.after_step with correction: θ ← θ − lr·(c/ω_i − c_i)
    shift = ctx.scratch.get("feddc_shift")
    return None if shift is None else (list(shift), -float(ctx.settings.lr))


def _moon_term(algo: LocalAlgorithm, ctx: LocalContext) -> FrozenTermFn | None:
    """``Moon.loss``'s model-contrastive term per client: ``mu · mean_b(−pos + logsumexp(pos, neg))``, cosine
    similarities over ``tau`` of the trained body's output with the received and the previous model's."""
    mu, tau = float(algo.mu), float(algo.tau)  # type: ignore[attr-defined]
    if mu == 0:
        return None

    def term(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
        pos = F.cosine_similarity(feats, outs["received"][0], dim=2) / tau
        neg = F.cosine_similarity(feats, outs["previous"][0], dim=2) / tau
        return mu * (-pos + torch.logsumexp(torch.stack([pos, neg], dim=2), dim=2)).mean(1)

    return term


def _moon_previous(ctx: LocalContext) -> Params | None:
    # Moon.begin decided: the contrastive term only with a previous local model
    return ctx.client_state.get("moon_prev") if ctx.scratch.get("moon_contrast") else None


def _ntd_term(algo: LocalAlgorithm, ctx: LocalContext) -> FrozenTermFn | None:
    """``FedNTD.loss``'s not-true distillation per client: ``beta · ntd_loss`` with the received model's logits,
    its batch mean taken per client."""
    beta, tau = float(algo.beta), float(algo.tau)  # type: ignore[attr-defined]
    if beta == 0:
        return None

    def term(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
        k, b, c = logits.shape
        flat_y = y.reshape(k * b)
        log_p = F.log_softmax(not_true_logits(logits.reshape(k * b, c), flat_y) / tau, dim=1)
        q = F.softmax(not_true_logits(outs["received"][1].reshape(k * b, c), flat_y) / tau, dim=1)
        kl = F.kl_div(log_p, q, reduction="none").view(k, b, -1).sum(dim=(1, 2)) / b
        return beta * tau**2 * kl

    return term


def _proto_term(algo: LocalAlgorithm, ctx: LocalContext) -> FrozenTermFn | None:
    """``FedProto.loss``'s term per client: ``lam ·`` the MSE between each feature and its class's global prototype
    (the feature itself where the class has none); none before the first global prototypes (broadcast: the same for
    every client of the round)."""
    lam = float(algo.lam)  # type: ignore[attr-defined]
    if ctx.scratch.get("protos") is None or lam == 0:
        return None
    protos, present = ctx.scratch["protos"]

    def term(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
        target = torch.where(present[y].unsqueeze(-1), protos[y], feats.detach())
        return lam * ((feats - target) ** 2).mean(dim=(1, 2))

    return term


def _proc_term(algo: LocalAlgorithm, ctx: LocalContext) -> FrozenTermFn | None:
    """``FedProc.loss`` = ``α·L_pc + (1 − α)·CE`` as the cross-entropy plus ``α·(L_pc − CE)`` per client (α the
    round's curriculum weight); none before the first global prototypes."""
    if ctx.scratch.get("protos") is None:
        return None
    protos, present = ctx.scratch["protos"]
    a = algo.alpha(ctx.round, ctx.settings.rounds)  # type: ignore[attr-defined]
    temperature = float(algo.temperature)  # type: ignore[attr-defined]

    def term(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
        k, b, c = logits.shape
        flat_y = y.reshape(k * b)
        ce = F.cross_entropy(logits.reshape(k * b, c), flat_y, reduction="none").view(k, b).mean(1)
        pc = prototypical_contrastive(feats.reshape(k * b, -1), flat_y, protos, present, temperature)
        return a * (pc.view(k, b).mean(1) - ce)

    return term


def _fedgen_term(algo: LocalAlgorithm, ctx: LocalContext) -> GeneratedTerm | None:
    """``FedGen.loss``'s regularizer per client: ``gen_weight · CE(head(z), ŷ)``, ``z`` the round's generator (the
    one ``FedGen.begin`` loaded from the broadcast, in training mode) on the labels and noise the client drew."""
    weight, batch, noise_dim = float(algo.gen_weight), int(algo.gen_batch_size), int(algo.noise_dim)  # type: ignore[attr-defined]
    if weight == 0:
        return None
    shares, gen = ctx.broadcast[FEDGEN_LABELS], ctx.scratch["fedgen"]

    def inputs(labels: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
        return gen.forward_rows(labels, noise), labels

    def term(head: Callable[[Tensor], Tensor], drawn: tuple[Tensor, Tensor]) -> Tensor:
        z, labels = drawn
        logits = head(z)
        r, g = labels.shape
        ce = F.cross_entropy(logits.reshape(r * g, -1), labels.reshape(r * g), reduction="none")
        return weight * ce.view(r, g).mean(1)

    return GeneratedTerm(draw=lambda generator: draw(shares, batch, noise_dim, generator), inputs=inputs, term=term)


# the client parts whose local step is batched (exact types: a subclass may override any hook)
BATCHED_STEPS: dict[type[LocalAlgorithm], BatchedStep] = {
    LocalAlgorithm: BatchedStep(),
    FedProx: BatchedStep(prox_mu=lambda algo, phase: float(algo.mu)),  # type: ignore[attr-defined]
    Scaffold: BatchedStep(shift=_scaffold_shift),
    FedDyn: BatchedStep(pull=_feddyn_pull, clip=lambda algo: float(algo.clip)),  # type: ignore[attr-defined]
    FedDC: BatchedStep(pull=_feddc_pull, clip=lambda algo: float(algo.clip), shift=_feddc_shift),  # type: ignore[attr-defined]
    Moon: BatchedStep(term=_moon_term, frozen=("received", "previous"), previous=_moon_previous),
    FedNTD: BatchedStep(term=_ntd_term, frozen=("received",)),
    FedProto: BatchedStep(term=_proto_term, collect=True),
    FedProc: BatchedStep(term=_proc_term, collect=True),
    # phases (engine: each its own schedule, optimizer and trained parameters; `keep` stored per client)
    Ditto: BatchedStep(prox_mu=lambda algo, phase: float(algo.lam) if phase == "personal" else 0.0),  # type: ignore[attr-defined]
    AmpClient: BatchedStep(prox_mu=lambda algo, phase: float(algo.mu)),  # type: ignore[attr-defined]
    FedRep: BatchedStep(),
    FedBABU: BatchedStep(),
    FedGen: BatchedStep(generated=_fedgen_term),
    # the weight learning runs in begin, per client on its own data and generator, as the sequential loop runs it
    FedALA: BatchedStep(start_after_begin=True),
}

# wrappers that add work in ``begin`` (on the received model, before training) or ``end`` (on the trained model), which
# the batched path runs per client on a real context, and hand every other hook to the client part they wrap: the
# loss before training that AFL, q-FFL and FedFV read, the loss after training on the validation split (AFL loss=after)
WRAPPERS: tuple[type[LocalAlgorithm], ...] = (LossBefore, LossAfter)


def unwrapped(algo: LocalAlgorithm) -> LocalAlgorithm:
    """The client part whose local step runs: ``algo``, or the one a :data:`WRAPPERS` wrapper hands its hooks to."""
    while type(algo) in WRAPPERS:
        algo = algo.inner  # type: ignore[attr-defined]
    return algo


_RANDOM_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def batchable(method: Method, model: nn.Module | None = None) -> str | None:
    """Why ``method`` (on ``model``, when given) cannot be trained with batched clients; ``None`` when it can.

    Batched: the client parts of :data:`BATCHED_STEPS` (FedAvg's plain SGD, FedProx, SCAFFOLD, FedDyn, FedDC, MOON,
    FedNTD, FedGen, Ditto, FedRep, FedBABU, FedALA, FedAMP's client, FedProto, FedProc), with their uploads (FedCAC's
    masks) and any server plug-in (disco, heal, fedsa, fedper, fedbn, local, ...), since those change only what each
    client receives or how the server aggregates, or wrapped in :data:`WRAPPERS` (the loss before training that AFL,
    q-FFL and FedFV read; the loss after training that AFL's ``loss=after`` reads). Refused, with the reason: a
    client part not listed (a user's own), MOON's, FedNTD's, FedGen's, FedProto's or FedProc's term on a model
    without a stacked form, a model with random layers (dropout) or a cumulative-average BatchNorm
    (``momentum=None``)."""
    algo = unwrapped(method.client)
    if type(algo) not in BATCHED_STEPS:
        hooks = [h for h in HOOKS if getattr(type(algo), h, None) is not getattr(LocalAlgorithm, h)]
        known = ", ".join(sorted(a.__name__ for a in BATCHED_STEPS))
        detail = f" and overrides {', '.join(hooks)}" if hooks else ""
        return f"its client part is {type(algo).__name__}{detail}; only {known} have a batched local step"
    if model is not None:
        for name, module in model.named_modules():
            if isinstance(module, _RANDOM_LAYERS):
                return f"the model has a random layer ({name}: {type(module).__name__}); batched draws would differ"
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None:
                return f"the model's BatchNorm {name} uses a cumulative average (momentum=None)"
        if not (hasattr(model, "body") and hasattr(model, "head")):
            return "the model has no body/head split"
        rule = BATCHED_STEPS[type(algo)]
        if rule.term is not None or rule.collect or rule.generated is not None:
            why = stackable(model.body) or stackable(model.head)
            if why is not None:
                name = type(algo).__name__
                return f"{name}'s loss term is batched for standard-layer models only ({why})"
    return None


def pull_rows(
    grads: list[Tensor], params: list[Tensor], alpha: Tensor, anchors: Any, linear: Any | None
) -> list[Tensor]:
    """``client.drift.add_pull`` on stacked rows: ``g + α_k·(θ − anchor) − linear`` per parameter tensor."""
    out = []
    lin = list(linear) if linear is not None else [None] * len(grads)
    for g, p, a, li in zip(grads, params, list(anchors), lin, strict=True):
        scale = alpha.view(-1, *([1] * (g.dim() - 1)))
        g = g + scale * (p - a)
        out.append(g if li is None else g - li)
    return out


def clip_rows(grads: list[Tensor], clip: float) -> list[Tensor]:
    """``torch.nn.utils.clip_grad_norm_(params, clip)`` per client row: each client's gradients scaled by
    ``min(1, clip / (‖g‖ + 1e-6))``, ``‖g‖`` the 2-norm over all its parameter tensors."""
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads], dim=1)
    coef = (clip / (torch.linalg.vector_norm(norms, dim=1) + 1e-6)).clamp(max=1.0)
    return [g * coef.view(-1, *([1] * (g.dim() - 1))) for g in grads]
