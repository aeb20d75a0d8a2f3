"""A client part's batched form: what its per-step hooks are on stacked clients, declared beside those hooks.

The batched path (:mod:`fedskew.engine.batched`) trains every client of a round at once, as rows of stacked
parameters. ``begin`` and ``end`` run per client on a real :class:`~fedskew.client.local.LocalContext`; only the
per-step hooks (``loss``, ``after_backward``, ``after_step``) need a stacked form, and each client part declares it
with :meth:`~fedskew.client.local.LocalAlgorithm.batched_step`, returning a :class:`BatchedStep` built from its own
hyper-parameters and from what its ``begin`` prepared (``ctx.prepared``, a typed value of the part's own). The engine
reads nothing else of a client part, so a user's part is batched by declaring that hook, without touching the engine
(docs/extending.md; ``examples/one_file_method.py``).

:func:`fedskew.client.local.batched_form` decides, for a client part as a run holds it (wrappers included), the form
to train with, or why there is none: a part that overrides a training hook below the class that declared the form (a
subclass of FedProx with its own ``loss``) is refused, since the form cannot know that hook.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from fedskew.protocol import Params

if TYPE_CHECKING:
    from fedskew.client.local import LocalContext

# a loss term against frozen models on the same batch: (the trained body's output [K, B, d], the logits [K, B, C],
# the labels [K, B], {frozen model name: its (body output, logits)}) -> the term per client [K], or per sample [K, B]
# (the engine then takes each client's mean over its batch's real samples: BatchedStep.term_per_sample)
FrozenTermFn = Callable[[Tensor, Tensor, Tensor, dict[str, tuple[Tensor, Tensor]]], Tensor]
# which samples of a padded batch are real: (0/1 weights [K, B], counts [K]), or None (every sample is real)
Padding = tuple[Tensor, Tensor] | None
# a loss term through the trained head on inputs drawn for the step (FedGen's generated features): (the clients'
# trained head on stacked inputs [K, G, d] -> [K, G, C], the step's drawn inputs) -> the term per client [K]
HeadTermFn = Callable[[Callable[[Tensor], Tensor], Any], Tensor]


def padded_mean(t: Tensor, padding: Padding) -> Tensor:
    """Each client's mean over its batch (``t`` ``[K, B, ...]`` -> ``[K, ...]``): over the real samples of a padded
    batch (``padding``: ``(weights [K, B], counts [K])``, :mod:`fedskew.engine.captured`), else over all ``B``. A
    padding sample is selected out, not multiplied by 0: its loss may be infinite (FedRoD's balanced softmax shifts
    the logits of a class the client lacks by ``log 0``, and a padding slot holds any sample of the round)."""
    if padding is None:
        return t.mean(1)
    weights, counts = padding
    tail = (1,) * (t.dim() - 2)
    real = weights.view(*weights.shape, *tail) > 0
    return torch.where(real, t, torch.zeros((), dtype=t.dtype, device=t.device)).sum(1) / counts.view(-1, *tail)


@dataclass(frozen=True)
class PaddedTerm:
    """A loss term of each client's batch as a whole (a statistic of the batch: FedDecorr's decorrelation) that reads
    which samples are real: ``fn(features, logits, labels, frozen outputs, padding)`` -> ``[K]``, where ``padding`` is
    ``None`` (every sample real) or ``(weights [K, B], counts [K])`` (:mod:`fedskew.engine.captured`). A
    :class:`BatchedStep`'s ``term`` may return one; its ``term_padded`` says whether the value covers the real samples
    only (so that the term runs at captured shapes)."""

    fn: Callable[[Tensor, Tensor, Tensor, dict[str, tuple[Tensor, Tensor]], Padding], Tensor]

    def __call__(
        self, feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]], padding: Padding
    ) -> Tensor:
        return self.fn(feats, logits, y, outs, padding)


class Shift(NamedTuple):
    """Tensors added to the trainable parameters after every optimizer step, outside the optimizer's momentum, and
    their scale (SCAFFOLD: ``c − c_i`` and ``−lr``)."""

    tensors: list[Tensor]
    scale: float


class Pull(NamedTuple):
    """A gradient term added after the backward pass: ``α·(θ − anchor) − linear`` (FedDyn, FedDC; ``linear`` may be
    ``None``)."""

    alpha: float
    anchors: list[Tensor]
    linear: list[Tensor] | None = None


class Blend(NamedTuple):
    """The gradient after the backward pass becomes ``share·g + (1 − share)·direction`` (MoFedSAM's client momentum;
    ``direction``: one tensor per trained parameter, or ``None``: ``share·g`` alone)."""

    share: float
    direction: list[Tensor] | None


class SideHead(NamedTuple):
    """A client's linear head trained beside the model (FedRoD's personal head): ``weight`` ``[C, d]`` and ``bias``
    ``[C]``, the tensors its ``loss`` and ``after_step`` train, which the batched path trains on its stacked rows and
    writes back into at the end of the phase."""

    weight: Tensor
    bias: Tensor


class Representation(NamedTuple):
    """Pieces on a client's representation ``z = body(x)`` (FedDBE's PRBM and MR): ``bias`` ``[d]``, added to ``z``
    before the head and trained beside the model by plain SGD at the run's learning rate (``None``: no bias); the
    running mean of the batch means ``r ← (1 − momentum)·r + momentum·mean(z)`` from ``running`` ``[d]`` (carried
    across steps, the gradient through the current batch only), pulled to ``target`` by
    ``weight·mean(½(r − target)²)`` (``target`` ``None``: ``r`` only tracked). The batched path writes the trained
    bias and the last ``r`` back into ``bias`` and ``running``."""

    bias: Tensor | None
    running: Tensor
    momentum: float
    target: Tensor | None
    weight: float


def split_batch(n: int, parts: int) -> list[slice]:
    """``parts`` consecutive slices of a batch of ``n``, each ``⌈n/parts⌉`` long; a slice past the end reuses the
    first (a batch too small to split)."""
    size = math.ceil(n / parts)
    out = []
    for i in range(parts):
        lo = i * size
        out.append(slice(lo, min(lo + size, n)) if lo < n else slice(0, size))
    return out


class InnerStep(NamedTuple):
    """The step's gradient taken through one inner step (Per-FedAvg's MAML objective): each batch is cut into
    ``parts`` slices (:func:`split_batch`); the gradient of the first slice's loss (on the whole batch's forward)
    gives ``w' = w − lr·g`` (``lr`` ``None``: the run's), and the gradient at ``w'`` on the second slice is the
    direction; with ``hessian_free``, minus ``lr·[∇f(w + δu) − ∇f(w − δu)]/(2δ)`` on the third. The reported loss is
    the second slice's at ``w'``."""

    parts: int
    lr: float | None
    hessian_free: bool
    delta: float


class Envelope(NamedTuple):
    """A personalized model solved at every step (pFedMe's Moreau envelope): ``theta`` (one live tensor per trained
    parameter, continued from step to step) takes ``steps`` plain steps at ``lr`` on
    ``f(θ; batch) + (lam/2)‖θ − w‖² + (mu/2)‖θ‖²`` (``f`` run with ``w``'s buffers, which it does not move); the
    model's gradient is then ``lam·(w − θ)`` and the reported loss ``θ``'s last. Written back at the end."""

    theta: Params
    lam: float
    steps: int
    lr: float
    mu: float


class Mixture(NamedTuple):
    """A second model trained beside the model through a mixture (APFL's ``v`` and ``α``): ``v`` (one live tensor
    per trained parameter) and ``alpha`` (0-d, live). Every step adds ``CE(f(α·v + (1 − α)·w.detach()), y)`` to the
    loss (the mixed model run with ``w``'s buffers, which it does not move); ``v`` takes plain SGD at the run's
    learning rate and, when ``adaptive``, ``α ← clip(α − lr·(∂α + alpha_l2·α), 0, 1)``. The batched path writes
    both back at the end."""

    v: Params
    alpha: Tensor
    adaptive: bool
    alpha_l2: float


# a loss term computed for one client at a time (inside vmap: any model): (the model, the client's state by full
# names: trained parameters and buffers, the body's output [B, d], the labels [B], the inputs [B, ...], the client's
# own rows of the received model's entries the term reads) -> a scalar
ClientTermFn = Callable[[nn.Module, dict[str, Tensor], Tensor, Tensor, Tensor, dict[str, Tensor]], Tensor]


# the same term on stacked clients: (the stacked forward of the model's modules by path,
# :class:`fedskew.engine.stacked.StackedRun`; the clients' stacked state by full names [K, ...], trained parameters
# live; the body's output [K, B, d]; the labels [K, B]; the inputs [K, B, ...]; the clients' rows of the received
# entries the term reads; the padding, :data:`Padding`) -> the term per client [K], over each batch's real samples
StackedTermFn = Callable[[Any, dict[str, Tensor], Tensor, Tensor, Tensor, dict[str, Tensor], Padding], Tensor]


class ClientTerm(NamedTuple):
    """A loss term of each client's own trained state (any model, a composite head included): ``fn``
    (:data:`ClientTermFn`), computed one client at a time under ``vmap``; ``reads``, the received model's entries
    (full names) it reads, each client's own (GPFL's path through its trained valve and embeddings; FedCP's MMD to
    the received body's features); ``stacked``, the same term on stacked clients (:data:`StackedTermFn`), over each
    batch's real samples, with which the step runs on the stacked graph, and at captured shapes, when the model has
    a stacked form (``BatchedStep.client_term_stacked`` says it is given). A form that returns the same term for the
    same hyper-parameters (a module-level ``functools.cache``) replays the same captured graphs every round."""

    fn: ClientTermFn
    reads: tuple[str, ...] = ()
    stacked: StackedTermFn | None = None


class HeadDraw(NamedTuple):
    """Random inputs a client's head draws at every training forward (FedCP's Gumbel noise), drawn by the batched
    path from the client's own stream in its step order, as the sequential forward draws them, and passed to the
    head's forward as its keyword ``name``: ``draw(b)``, one step's draw for a batch of ``b``."""

    name: str
    draw: Callable[[int], Tensor]


class LogitMap(NamedTuple):
    """A client's fixed map of its logits before the cross-entropy, ``logits · scale + shift`` (``[C]`` each;
    ``None``: that part is absent): FedRS's restricted softmax (``scale``), FedLC's calibration (``shift``)."""

    scale: Tensor | None
    shift: Tensor | None


def map_logits(logits: Tensor, scale: Tensor | None, shift: Tensor | None) -> Tensor:
    """``logits · scale + shift`` over the last (class) axis, one map per leading row (``logits`` ``[..., B, C]``,
    ``scale``/``shift`` ``[..., C]``); a part that is ``None`` is left out, so the map does what the sequential
    loss does, operation for operation."""
    if scale is not None:
        logits = logits * scale.unsqueeze(-2)
    if shift is not None:
        logits = logits + shift.unsqueeze(-2)
    return logits


class ClassSums(Protocol):
    """Where a client collects its last epoch's per-class feature sums (FedProto's and FedProc's prototypes): from
    local step ``collect_from`` on; the batched path fills ``sums`` ``[C, D]`` and ``counts`` ``[C]`` (float64) as
    the sequential loop's ``loss`` hook leaves them for ``end``."""

    collect_from: int
    sums: Tensor | None
    counts: Tensor | None


@dataclass(frozen=True)
class GeneratedTerm:
    """A loss term on inputs every client draws at every step from its own generator, through its trained head
    (FedGen's ``gen_weight · CE(head(G(ŷ, ε)), ŷ)``). ``draw``: one client's draw for one step (on the CPU; the
    schedule makes the draws in the sequential loop's order: after each epoch's permutation, one per batch);
    ``inputs``: the drawn rows of a step's clients stacked (``[R, ...]``) → what ``term`` reads, computed without
    gradient; ``term``: (the clients' trained head on stacked inputs, those inputs) → the term per client ``[R]``."""

    draw: Callable[[Any], tuple[Tensor, ...]]
    inputs: Callable[..., Any]
    term: HeadTermFn


@dataclass(frozen=True)
class BatchedStep:
    """How one client part's per-step hooks are computed on stacked clients (every field optional: the default is
    plain SGD on the cross-entropy, FedAvg's client).

    ``prox_mu``: per phase name, the weight of the proximal term ``(mu/2)·Σ‖w − w_received‖²`` over the phase's
    trained parameters (FedProx; Ditto's personal phase; FedAMP's client; 0: none). ``shift``: per client after
    ``begin``, a :class:`Shift` after every optimizer step (SCAFFOLD, FedDC), or ``None``. ``pull``: per client after
    ``begin``, a :class:`Pull` on the gradient (FedDyn, FedDC), and ``clip``: the client's total gradient-norm clip
    applied then (0: none). ``term``: from the first client's context, a loss term against frozen models on the same
    batch (``None``: off; models of standard layers only, engine/stacked.py), reading the frozen models ``frozen``
    (``"received"``; ``"previous"``: per client ``previous(ctx)``, ``None`` where the term is absent for that client,
    as MOON's on a first participation). ``term_per_sample``: the term returns each sample's value ``[K, B]``, which
    the engine averages over each batch's real samples, so that it runs at captured shapes too
    (:mod:`fedskew.engine.captured`); a form whose ``term`` returns the same function for the same hyper-parameters
    (a module-level ``functools.cache``) replays the same CUDA graphs every round, while a new function (one reading
    tensors of its round) gets graphs of its own. ``term_padded``: the term is a :class:`PaddedTerm` whose value covers
    each batch's real samples only (FedDecorr's statistic of the batch), so that it runs at captured shapes too.
    ``collect``: per client, where its last-epoch class sums go
    (:class:`ClassSums`). ``generated``: a :class:`GeneratedTerm` (FedGen). ``start_after_begin``: the client trains
    from the model its ``begin`` leaves (FedALA's blended top layers), not from the received model. ``begin_all``:
    every client's ``begin`` at once, on the contexts of the round's clients (sharing the model): it does what each
    ``begin`` would and returns each client's start, or ``None`` where it does not apply (then each client's ``begin``
    runs in turn, as the sequential loop runs it). ``logits``: per client after ``begin``, given the number of classes,
    a :class:`LogitMap` of its logits before the cross-entropy (FedLC, FedRS; the same parts on every client).
    ``sam_rho``: every step is a SAM step of this radius (0: none): the gradient at ``w`` gives each client's ascent
    ``ε = ρ·g/(‖g‖ + 1e-12)`` (one norm over its trained parameters), and the gradient at ``w + ε`` (on the same batch,
    its buffers discarded) replaces ``g`` (FedSAM). ``blend``: per client after ``begin``, a :class:`Blend` of that
    gradient with a fixed direction, applied next (MoFedSAM). ``side_head``: per client after ``begin``, a
    :class:`SideHead` trained beside the model on ``CE(logits.detach() + head(features.detach()), y)`` (its loss added
    to the step's) by plain SGD at the run's learning rate after every step (FedRoD's personal head).
    ``representation``: per client after ``begin``, a :class:`Representation` (FedDBE). ``mixture``: per client
    after ``begin``, a :class:`Mixture` (APFL). ``inner``: an :class:`InnerStep` (Per-FedAvg). ``envelope``: per
    client after ``begin``, an :class:`Envelope` (pFedMe). ``client_term``: from the first client's context, a
    :class:`ClientTerm` added to each client's loss, computed one client at a time (the steps then run under ``vmap``
    whatever the model), unless ``client_term_stacked``: its stacked form is given, and on a model with a stacked form
    the steps run on the stacked graph and at captured shapes (GPFL, FedCP). ``decay``: per trained parameter name, a
    weight ``μ`` whose ``μ·θ`` is added to the gradient after the backward pass, before the optimizer's own weight
    decay (0: none; GPFL's valve and embeddings).
    ``head_draw``: per client after ``begin``, a :class:`HeadDraw` (FedCP), its draws passed to the head's forward
    (``vmap``'s, or the head's own stacked form's).
    """

    prox_mu: Callable[[str], float] | None = None
    shift: Callable[[LocalContext], Shift | None] | None = None
    pull: Callable[[LocalContext], Pull] | None = None
    clip: float = 0.0
    term: Callable[[LocalContext], FrozenTermFn | None] | None = None
    frozen: tuple[str, ...] = ()
    previous: Callable[[LocalContext], Params | None] | None = None
    term_per_sample: bool = False
    term_padded: bool = False
    collect: Callable[[LocalContext], ClassSums] | None = None
    generated: Callable[[LocalContext], GeneratedTerm | None] | None = None
    start_after_begin: bool = False
    begin_all: Callable[[list[LocalContext]], list[Params] | None] | None = None
    logits: Callable[[LocalContext, int], LogitMap] | None = None
    sam_rho: float = 0.0
    blend: Callable[[LocalContext], Blend] | None = None
    side_head: Callable[[LocalContext], SideHead] | None = None
    representation: Callable[[LocalContext], Representation] | None = None
    mixture: Callable[[LocalContext], Mixture] | None = None
    inner: InnerStep | None = None
    envelope: Callable[[LocalContext], Envelope] | None = None
    client_term: Callable[[LocalContext], ClientTerm | None] | None = None
    client_term_stacked: bool = False
    decay: Callable[[str], float] | None = None
    head_draw: Callable[[LocalContext], HeadDraw] | None = None

    @property
    def has_term(self) -> bool:
        """Whether the form has a loss term computed on the stacked graph (models of standard layers only)."""
        terms = (self.term, self.collect, self.generated, self.side_head, self.representation, self.mixture)
        return any(t is not None for t in (*terms, self.inner, self.envelope))
