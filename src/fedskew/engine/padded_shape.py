"""What a phase's padded steps (:mod:`fedskew.engine.captured`) take and give: the rows they start from
(:class:`PaddedRows`), the shape their buffers and captured graphs bake in (:class:`PaddedShape`, from
:func:`shape_of`) and their result (:class:`PaddedResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from fedskew.client.batched_form import (
    BatchedStep,
    ClientTerm,
    FrozenTermFn,
    GeneratedTerm,
    HeadDraw,
    HeadTermFn,
    InnerStep,
    StackedTermFn,
)
from fedskew.engine.batched_steps import Flat
from fedskew.engine.padded_plan import PaddedPlan

if TYPE_CHECKING:
    from fedskew.client.local import TrainSettings
    from fedskew.engine.batched_rows import Beside


@dataclass(frozen=True)
class PaddedShape:
    """Everything a phase's captured steps bake in: the sizes of their buffers and the optimizer's constants."""

    rows: int
    batch: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]  # the trained tensors' shapes, in ``names`` order
    dim: int
    fixed: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # the other entries: names, shapes, dtypes
    x: tuple[int, ...]
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]  # the parameters', the inputs' and the labels'
    lr: float
    mu: float
    momentum: float
    weight_decay: float
    anchor: bool
    shift: float | None
    pull: tuple[bool, float] | None  # (a linear term, the clip)
    logit_map: tuple[int | None, int | None] = (None, None)  # the classes of the logits' scale and shift, if any
    sam_rho: float = 0.0  # SAM's radius (0: plain steps)
    blend: tuple[float, bool] | None = None  # (the gradient's share, a direction given)
    precision: str = "float32"  # the forward passes' arithmetic (client/precision.py)
    # what the clients train beside the model (engine/batched_rows.py's Beside): its rows' keys, shapes and dtypes,
    # their plain SGD's learning rate, FedDBE's (momentum, a target given, weight), APFL's (adaptive, alpha_l2)
    beside: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()
    beside_lr: float = 0.0
    represent: tuple[float, bool, float] | None = None
    mixture: tuple[bool, float] | None = None
    # a loss term against frozen models, per sample (MOON, FedNTD; the function itself: a new one, new graphs), the
    # frozen models' entries (name -> keys, shapes, dtypes) and whether a per-client mask applies it
    term: FrozenTermFn | None = None
    frozen: tuple[tuple[str, tuple[tuple[str, tuple[int, ...], torch.dtype], ...]], ...] = ()
    term_mask: bool = False
    collect: int | None = None  # the classes of the last epoch's class sums of the features (FedProto, FPL)
    inner: InnerStep | None = None  # Per-FedAvg's inner step, its learning rate resolved
    envelope: tuple[float, int, float, float] | None = None  # pFedMe's (lam, steps, lr, mu); θ's rows in ``beside``
    generated: HeadTermFn | None = None  # FedGen's term on the inputs drawn for each step (a new function: new graphs)
    # a client's own term on the stacked graph (GPFL, FedCP: its stacked form) and the received entries it reads
    client_term: StackedTermFn | None = None
    reads: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()
    decay: tuple[float, ...] | None = None  # per trained tensor, the μ of μ·θ added to its gradient (GPFL)
    head_draw: str | None = None  # the head's keyword its draws go to (FedCP's Gumbel noise, drawn per row and step)


class PaddedResult(NamedTuple):
    """What a phase's padded steps give, in client order: the trained ``[K, D]`` rows, each client's summed
    ``batch loss × batch size`` (float64), the rows trained beside the model (by key) and, when the form collects
    them, the last epoch's per-class feature sums ``[K, C, d]`` and counts ``[K, C]`` (float64)."""

    params: Tensor
    losses: Tensor
    beside: dict[str, Tensor]
    sums: Tensor | None = None
    counts: Tensor | None = None
    fixed: dict[str, Tensor] | None = None  # the model's buffers after the steps (BatchNorm's statistics moved)


@dataclass
class PaddedRows:
    """What a phase's padded steps start from, every ``[K, ...]`` tensor in client order: the trained ``params``
    ``[K, D]`` and ``fixed``, the other entries of the clients' state dicts. The rest is what the client part's
    batched form asks for (``None``: not asked). ``anchor``: FedProx's received rows; ``shift``: SCAFFOLD's
    ``(c − c_i rows, scale)`` after each step; ``pull``: FedDyn's ``(α [K], anchor rows, linear rows or None)`` on the
    gradient, clipped by the rule's ``clip``; ``logit_map``: the clients' ``(scale, shift)`` of their logits before the
    loss (``[K, C]`` each or ``None``); ``blend``: ``(share, direction rows or None)`` mixed into the gradient after
    SAM's; ``beside``: what the clients train beside the model (:class:`~fedskew.engine.batched_rows.Beside`) and its
    rows ``beside_rows`` by key; ``term``: a per-sample loss term against frozen models, the frozen models' rows (name
    -> rows by key) and the ``[K]`` mask of the clients it applies to (``None``: all); ``collect``: the classes and
    each client's first step (``[K]``) of the last epoch's class sums; ``generated``: FedGen's term and the schedule's
    draws; ``client_term``: a client's own term with its stacked form (GPFL, FedCP) and ``reads``, the rows of the
    received entries it reads; ``head_draws``: each client's draws of its head (FedCP)."""

    params: Tensor
    fixed: dict[str, Tensor]
    anchor: Tensor | None = None
    shift: tuple[Tensor, float] | None = None
    pull: tuple[Tensor, Tensor, Tensor | None] | None = None
    logit_map: tuple[Tensor | None, Tensor | None] | None = None
    blend: tuple[float, Tensor | None] | None = None
    beside: Beside | None = None
    beside_rows: dict[str, Tensor] = field(default_factory=dict)
    term: tuple[FrozenTermFn, dict[str, dict[str, Tensor]], Tensor | None] | None = None
    collect: tuple[int, Tensor] | None = None
    generated: tuple[GeneratedTerm, tuple[Tensor, ...]] | None = None
    client_term: ClientTerm | None = None
    reads: dict[str, Tensor] = field(default_factory=dict)
    head_draws: list[HeadDraw] | None = None


def shape_of(
    rule: BatchedStep,
    settings: TrainSettings,
    lr: float,
    mu: float,
    flat: Flat,
    plan: PaddedPlan,
    x_all: Tensor,
    y_all: Tensor,
    given: PaddedRows,
) -> PaddedShape:
    """The shape of a phase's padded steps: what its buffers and its captured graphs bake in."""
    params, beside = given.params, given.beside
    reps = beside.reps if beside is not None else []
    mixes = beside.mixes if beside is not None else []
    envs = beside.envs if beside is not None else []
    term = given.term
    if given.client_term is not None and given.client_term.stacked is None:  # refused, not trained without it
        raise ValueError(
            "the client part's batched form declares a stacked client term (client_term_stacked), but its ClientTerm "
            "has no stacked form (stacked=None): it cannot run at captured shapes"
        )
    # the inner step's learning rate: its own, or the run's (``None``), as the bucketed loop resolves it
    if rule.inner is not None and rule.inner.lr is None:
        rule = replace(rule, inner=rule.inner._replace(lr=settings.lr))
    return PaddedShape(
        rows=int(params.shape[0]),
        batch=plan.batch,
        names=tuple(flat.names),
        shapes=tuple(tuple(s) for s in flat.shapes),
        dim=int(params.shape[1]),
        fixed=tuple((k, tuple(v.shape[1:]), v.dtype) for k, v in given.fixed.items()),
        x=tuple(x_all.shape[1:]),
        dtypes=(params.dtype, x_all.dtype, y_all.dtype),
        lr=float(lr),
        mu=float(mu),
        momentum=float(settings.momentum),
        weight_decay=float(settings.weight_decay),
        anchor=given.anchor is not None,
        shift=None if given.shift is None else float(given.shift[1]),
        pull=None if given.pull is None else (given.pull[2] is not None, float(rule.clip)),
        logit_map=tuple(None if m is None else int(m.shape[1]) for m in (given.logit_map or (None, None))),  # type: ignore[arg-type]
        sam_rho=float(rule.sam_rho),
        blend=None if given.blend is None else (float(given.blend[0]), given.blend[1] is not None),
        precision=settings.precision,
        beside=tuple((key, tuple(v.shape[1:]), v.dtype) for key, v in given.beside_rows.items()),
        beside_lr=float(beside.lr) if beside is not None else 0.0,
        represent=(float(reps[0].momentum), reps[0].target is not None, float(reps[0].weight)) if reps else None,
        mixture=(bool(mixes[0].adaptive), float(mixes[0].alpha_l2)) if mixes else None,
        term=None if term is None else term[0],
        frozen=()
        if term is None
        else tuple(
            (m, tuple((key, tuple(v.shape[1:]), v.dtype) for key, v in state.items())) for m, state in term[1].items()
        ),
        term_mask=term is not None and term[2] is not None,
        collect=None if given.collect is None else int(given.collect[0]),
        inner=rule.inner,
        generated=None if given.generated is None else given.generated[0].term,
        envelope=None if not envs else (float(envs[0].lam), int(envs[0].steps), float(envs[0].lr), float(envs[0].mu)),
        client_term=None if given.client_term is None else given.client_term.stacked,
        reads=tuple((key, tuple(v.shape[1:]), v.dtype) for key, v in given.reads.items()),
        decay=_decays(rule, flat),
        head_draw=None if not given.head_draws else given.head_draws[0].name,
    )


def _decays(rule: BatchedStep, flat: Flat) -> tuple[float, ...] | None:
    """Per trained tensor, the μ of the form's decay (GPFL's valve and embeddings); ``None``: no tensor decays."""
    if rule.decay is None:
        return None
    decays = tuple(float(rule.decay(n)) for n in flat.names)
    return decays if any(decays) else None
