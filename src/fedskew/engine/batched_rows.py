"""What the batched clients carry through a phase (:mod:`fedskew.engine.batched`): :class:`Stack`, one row per
client still training (its parameters, buffers, loss sum, optimizer and term tensors); :class:`PhasePlan`, one phase
all clients share; :class:`Collect`, the per-class feature sums FedProto and FedProc read, gathered on the rows;
:class:`Beside`, what the clients train or track beside the model (a side head, pieces on the representation)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedskew.client.batched_form import BatchedStep, ClassSums, ClientTerm, FrozenTermFn
from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.engine.batched_steps import Flat
from fedskew.engine.stacked_step import ENV_THETA, MIX_ALPHA, MIX_V, REPR_BIAS, REPR_RUNNING, SIDE_BIAS, SIDE_WEIGHT
from fedskew.protocol import Params


@dataclass
class Stack:
    """The per-client tensors of the clients still training, one row each; ``live[r]`` is row r's client (its
    position in the group). Clients that have taken all their steps are retired (their rows kept in ``done``), so
    the steps where every live client shares a batch size, most of them, update the stack in place."""

    live: np.ndarray
    params: Tensor  # [R, D] trainable parameters
    extra: dict[str, Tensor]  # [R, ...] buffers (BatchNorm statistics) and frozen parameters
    loss: Tensor  # [R] float64 sum of batch loss x batch size, as local_train sums it
    buf: Tensor | None = None  # [R, D] SGD momentum buffers
    anchor: Tensor | None = None  # [R, D] received parameters (FedProx's proximal term)
    shift: Tensor | None = None  # [R, D] SCAFFOLD's c - c_i (FedDC's c/ω_i - c_i)
    pull_alpha: Tensor | None = None  # [R] α_k of a pull after the backward pass (FedDyn, FedDC)
    pull_anchor: Tensor | None = None  # [R, D] its anchor
    pull_linear: Tensor | None = None  # [R, D] its linear term (FedDyn's g_k)
    term_mask: Tensor | None = None  # [R] 1 where the frozen-model term applies (MOON), None: everywhere
    logit_scale: Tensor | None = None  # [R, C] each client's scale of its logits before the loss (FedRS)
    logit_shift: Tensor | None = None  # [R, C] and their shift (FedLC)
    blend_dir: Tensor | None = None  # [R, D] the direction a blend mixes into the gradient (MoFedSAM's Δ)
    frozen_models: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # "received"/"previous" -> [R, ...]
    shift_scale: float = 0.0  # the shift's scale (SCAFFOLD: −lr), the same for every client
    blend_share: float | None = None  # a blend's share of the gradient (MoFedSAM's α), None: no blend
    reads: dict[str, Tensor] = field(default_factory=dict)  # [R, ...] received entries a client term reads (GPFL)
    done: dict[int, tuple[Tensor, dict[str, Tensor], Tensor]] = field(default_factory=dict)

    _ROWS = (
        "params",
        "loss",
        "buf",
        "anchor",
        "shift",
        "pull_alpha",
        "pull_anchor",
        "pull_linear",
        "term_mask",
        "logit_scale",
        "logit_shift",
        "blend_dir",
    )

    def retire(self, keep: np.ndarray, sel: Tensor) -> None:
        """Keep only the rows where ``keep`` holds (``sel``: their positions, on the device); the others' final rows
        go to ``done`` (their loss as a 0-d tensor: no device sync per client)."""
        for r in np.nonzero(~keep)[0]:
            row = {k: v[r].clone() for k, v in self.extra.items()}
            self.done[int(self.live[r])] = (self.params[r].clone(), row, self.loss[r].clone())
        for name in self._ROWS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[sel])
        self.extra = {k: v[sel] for k, v in self.extra.items()}
        self.frozen_models = {m: {k: v[sel] for k, v in rows.items()} for m, rows in self.frozen_models.items()}
        self.reads = {k: v[sel] for k, v in self.reads.items()}
        self.live = self.live[keep]


@dataclass(frozen=True)
class PhaseRows:
    """Where a phase's rows come from: the group's clients, what each received, each one's start of the phase, the
    trained parameters' layout, the state dict's order, the number of classes and the device."""

    cids: list[int]
    received: dict[int, Params]
    starts: list[Params]
    flat: Flat
    order: list[str]
    num_classes: int
    device: torch.device


@torch.no_grad()
def phase_stack(
    rule: BatchedStep,
    contexts: list[LocalContext],
    rows: PhaseRows,
    momentum: float,
    mu: float,
    term: FrozenTermFn | None,
    own_term: ClientTerm | None,
) -> Stack:
    """The stack a phase of the batched clients starts from: each client's trained rows and the rest of its state,
    a new optimizer's buffers, and the rows the form's pieces read (the proximal anchor, SCAFFOLD's shift, a pull,
    logit maps, a blend's direction, the frozen models of a term, the received entries of a client term)."""
    flat, device, cids, received = rows.flat, rows.device, rows.cids, rows.received
    names = flat.names
    params = flat.stack([[st[n] for n in names] for st in rows.starts]).to(device)
    others = [k for k in rows.order if k not in set(names)]  # buffers, frozen parameters, the phase's frozen ones
    extra = {k: torch.stack([st[k] for st in rows.starts]).to(device) for k in others}
    stack = Stack(np.arange(len(cids)), params, extra, torch.zeros(len(cids), dtype=torch.float64, device=device))
    stack.buf = torch.zeros_like(params) if momentum != 0 else None  # a new optimizer per phase
    stack.anchor = flat.stack([[received[c][n] for n in names] for c in cids]).to(device) if mu != 0 else None
    shifts = [rule.shift(ctx) for ctx in contexts] if rule.shift is not None else []
    if shifts and shifts[0] is not None:
        stack.shift = flat.stack([sh.tensors for sh in shifts]).to(device)  # type: ignore[union-attr]
        stack.shift_scale = shifts[0].scale
    if rule.pull is not None:
        pulls = [rule.pull(ctx) for ctx in contexts]
        stack.pull_alpha = torch.tensor([a for a, _, _ in pulls], dtype=params.dtype, device=device)
        stack.pull_anchor = flat.stack([anchor for _, anchor, _ in pulls]).to(device)
        if pulls and pulls[0][2] is not None:
            stack.pull_linear = flat.stack([lin for _, _, lin in pulls]).to(device)  # type: ignore[misc]
    if rule.logits is not None:  # each client's map of its logits before the loss (FedLC, FedRS)
        maps = [rule.logits(ctx, rows.num_classes) for ctx in contexts]
        scales, offsets = [m.scale for m in maps], [m.shift for m in maps]
        if scales[0] is not None:
            stack.logit_scale = torch.stack(scales).to(device=device, dtype=params.dtype)  # type: ignore[arg-type]
        if offsets[0] is not None:
            stack.logit_shift = torch.stack(offsets).to(device=device, dtype=params.dtype)  # type: ignore[arg-type]
    if rule.blend is not None:  # MoFedSAM: g <- share·g + (1 − share)·Δ, Δ each client's (none before round 2)
        blends = [rule.blend(ctx) for ctx in contexts]
        stack.blend_share = blends[0].share
        if blends[0].direction is not None:
            stack.blend_dir = flat.stack([b.direction for b in blends]).to(device)  # type: ignore[misc]
    if own_term is not None:  # each client's rows of the received entries its term reads (GPFL's embeddings)
        stack.reads = {k: torch.stack([received[c][k] for c in cids]).to(device) for k in own_term.reads}
    if term is not None:
        glob = [received[c] for c in cids]
        models = {"received": glob}
        if "previous" in rule.frozen and rule.previous is not None:
            previous = [rule.previous(ctx) for ctx in contexts]
            stack.term_mask = torch.tensor([p is not None for p in previous], dtype=params.dtype, device=device)
            models["previous"] = [p if p is not None else g for p, g in zip(previous, glob, strict=True)]
        stack.frozen_models = {
            m: {k: torch.stack([state[k] for state in states]).to(device) for k in rows.order}
            for m, states in models.items()
            if m in rule.frozen
        }
    return stack


@dataclass
class PhasePlan:
    """One phase of every client's local training (``LocalAlgorithm.phases``): the same name, epochs, trained
    parameters and ``keep`` for all of them; each client's own start (``None``: continue from where it is)."""

    name: str
    epochs: int
    trains: list[str]
    keep: str | None
    lr: float | None
    starts: list[Params | None]


def phase_plans(algo: LocalAlgorithm, contexts: list[LocalContext], trainable: list[str]) -> list[PhasePlan]:
    """The clients' phases, which must agree in everything but their starts (else ``ValueError``, naming both)."""
    plans: list[PhasePlan] = []
    per_client = [algo.phases(ctx) for ctx in contexts]
    for k, phases in enumerate(per_client):
        shape = [
            (ph.name, ph.epochs, [n for n in trainable if ph.trains is None or ph.trains(n)], ph.keep, ph.lr)
            for ph in phases
        ]
        if k == 0:
            plans = [PhasePlan(name, ep, tr, keep, lr, []) for name, ep, tr, keep, lr in shape]
        elif shape != [(p.name, p.epochs, p.trains, p.keep, p.lr) for p in plans]:
            raise ValueError(
                f"batched clients need the same phases on every client: client {contexts[k].cid} has "
                f"{[(n, e) for n, e, *_ in shape]}, client {contexts[0].cid} {[(p.name, p.epochs) for p in plans]}"
            )
        for plan, ph in zip(plans, phases, strict=True):
            plan.starts.append(ph.start)
    return plans


class Collect:
    """FedProto's and FedProc's ``collect`` on stacked clients: from each client's ``collect_from`` step (its last
    epoch) on, the per-class float64 sums and counts of its body's outputs; handed over to where each client's
    ``end`` reads them (its :class:`~fedskew.client.batched_form.ClassSums`), as the sequential loop leaves them."""

    def __init__(self, targets: list[ClassSums], num_classes: int, device: torch.device) -> None:
        self.targets = targets
        self.start = torch.tensor([t.collect_from for t in targets], device=device)
        self.num_classes = num_classes
        self.sums: Tensor | None = None
        self.counts = torch.zeros((len(targets), self.num_classes), dtype=torch.float64, device=device)

    def add(self, t: int, members: Tensor, feats: Tensor, y: Tensor) -> None:
        if self.sums is None:
            shape = (self.counts.shape[0], self.num_classes, feats.shape[-1])
            self.sums = torch.zeros(shape, dtype=torch.float64, device=feats.device)
        on = (self.start[members] <= t).to(torch.float64)  # [R]: which of these clients are in their last epoch
        onehot = F.one_hot(y, self.num_classes).to(torch.float64) * on.view(-1, 1, 1)  # [R, B, C]
        self.sums.index_add_(0, members, torch.einsum("rbc,rbd->rcd", onehot, feats.to(torch.float64)))
        self.counts.index_add_(0, members, onehot.sum(1))

    def hand_over(self) -> None:
        for k, target in enumerate(self.targets):
            target.sums = None if self.sums is None else self.sums[k]
            target.counts = None if self.sums is None else self.counts[k]


class Beside:
    """What each client trains or tracks beside the model through a phase: a side head (FedRoD's personal head,
    ``BatchedStep.side_head``), the pieces on its representation (FedDBE's bias and running mean,
    ``BatchedStep.representation``), a second model in a mixture (APFL's ``v`` as ``[R, D]`` rows of the phase's
    trained parameters, and ``α``, ``BatchedStep.mixture``) and a personalized model solved at every step (pFedMe's
    ``θ``, ``BatchedStep.envelope``, advanced by the step's own loop). Their rows ride in the stack's ``extra`` under
    :data:`KEYS` (so a client's rows retire with it), go to the step as its ``side``, ``represent`` and ``mixture``
    arguments, advance after it (plain SGD at the run's learning rate; the running mean from the step's features; α
    by its own rule) and are written back at the end into the tensors the client part's hooks handed over, where its
    ``end`` reads them."""

    KEYS = (SIDE_WEIGHT, SIDE_BIAS, REPR_BIAS, REPR_RUNNING, MIX_V, MIX_ALPHA, ENV_THETA)

    def __init__(self, rule: BatchedStep, contexts: list[LocalContext], stack: Stack, lr: float, flat: Flat) -> None:
        device = stack.params.device
        self.lr, self.flat = lr, flat
        self.envs = [rule.envelope(ctx) for ctx in contexts] if rule.envelope is not None else []
        if self.envs:
            thetas = [[e.theta[n].detach() for n in flat.names] for e in self.envs]
            stack.extra[ENV_THETA] = flat.stack(thetas).to(device)
        self.mixes = [rule.mixture(ctx) for ctx in contexts] if rule.mixture is not None else []
        if self.mixes:
            stack.extra[MIX_V] = flat.stack([[m.v[n].detach() for n in flat.names] for m in self.mixes]).to(device)
            stack.extra[MIX_ALPHA] = torch.stack([m.alpha.detach() for m in self.mixes]).to(device)
        self.sides = [rule.side_head(ctx) for ctx in contexts] if rule.side_head is not None else []
        self.reps = [rule.representation(ctx) for ctx in contexts] if rule.representation is not None else []
        if self.sides:
            stack.extra[SIDE_WEIGHT] = torch.stack([h.weight.detach() for h in self.sides]).to(device)
            stack.extra[SIDE_BIAS] = torch.stack([h.bias.detach() for h in self.sides]).to(device)
        self.target: Tensor | None = None
        if self.reps:
            stack.extra[REPR_RUNNING] = torch.stack([r.running.detach() for r in self.reps]).to(device)
            biases = [r.bias for r in self.reps]
            if biases[0] is not None:
                stack.extra[REPR_BIAS] = torch.stack([b.detach() for b in biases if b is not None]).to(device)
            self.target = None if self.reps[0].target is None else self.reps[0].target.to(device)

    def __bool__(self) -> bool:
        return bool(self.sides or self.reps or self.mixes or self.envs)

    def step_args(self, rows: dict[str, Tensor]) -> dict[str, object]:
        """The step's keyword arguments for these clients' ``rows`` (their entries of the stack's ``extra``)."""
        out: dict[str, object] = {}
        if self.sides:
            out["side"] = (rows[SIDE_WEIGHT], rows[SIDE_BIAS])
        if self.reps:
            r = self.reps[0]
            out["represent"] = (rows.get(REPR_BIAS), rows[REPR_RUNNING], r.momentum, self.target, r.weight)
        if self.mixes:
            out["mixture"] = (self.flat.views(rows[MIX_V]), rows[MIX_ALPHA])
        return out

    def advance(self, rows: dict[str, Tensor], grads: dict[str, Tensor], feats: Tensor | None) -> dict[str, Tensor]:
        """The rows after the step: the trained ones stepped by plain SGD, the running mean
        ``r ← (1 − m)·r + m·mean(z)`` as the step computed it from ``feats`` ``[R, B, d]``."""
        new = {k: rows[k].sub(grads[k], alpha=self.lr) for k in (SIDE_WEIGHT, SIDE_BIAS, REPR_BIAS) if k in rows}
        if self.reps and feats is not None:
            m = self.reps[0].momentum
            new[REPR_RUNNING] = (1 - m) * rows[REPR_RUNNING] + m * feats.mean(1)
        if self.mixes:
            g_v = torch.cat([grads[MIX_V + n].flatten(1) for n in self.flat.names], dim=1)
            new[MIX_V] = rows[MIX_V].sub(g_v, alpha=self.lr)
            mix = self.mixes[0]
            if mix.adaptive:  # α ← clip(α − lr·(∂α + l2·α), 0, 1)
                alpha = rows[MIX_ALPHA]
                new[MIX_ALPHA] = alpha.sub(grads[MIX_ALPHA] + mix.alpha_l2 * alpha, alpha=self.lr).clamp(0.0, 1.0)
        return new

    def hand_back(self, stack: Stack) -> None:
        """Each client's trained rows into the tensors its hooks handed over (``stack.done``: every client retired)."""
        self.write_back(lambda k: stack.done[k][1])

    def hand_back_rows(self, rows: dict[str, Tensor]) -> None:
        """The same from ``[K, ...]`` rows under :data:`KEYS`, in client order (the padded steps' result)."""
        self.write_back(lambda k: {key: v[k] for key, v in rows.items()})

    @torch.no_grad()
    def write_back(self, rows_of: Callable[[int], dict[str, Tensor]]) -> None:
        """Client ``k``'s rows (``rows_of(k)``, by :data:`KEYS`) into the tensors its hooks handed over."""
        for k in range(max(len(self.sides), len(self.reps), len(self.envs), len(self.mixes))):
            row = rows_of(k)
            if self.sides:
                self.sides[k].weight.copy_(row[SIDE_WEIGHT])
                self.sides[k].bias.copy_(row[SIDE_BIAS])
            if self.reps:
                self.reps[k].running.copy_(row[REPR_RUNNING])
                if self.reps[k].bias is not None:
                    self.reps[k].bias.copy_(row[REPR_BIAS])
            if self.envs:
                for n, t in self.flat.views(row[ENV_THETA]).items():
                    self.envs[k].theta[n].copy_(t)
            if self.mixes:
                for n, t in self.flat.views(row[MIX_V]).items():
                    self.mixes[k].v[n].copy_(t)
                self.mixes[k].alpha.copy_(row[MIX_ALPHA])
