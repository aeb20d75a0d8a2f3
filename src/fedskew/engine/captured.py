"""Batched steps at one shape, so that a CUDA device can replay each step as one captured graph.

The bucketed step loop of :mod:`fedskew.engine.batched` is exact without padding, but its shapes change from step to
step (a client's short last batch, clients that finish early), and every step launches its few hundred kernels from
Python: on a GPU the small models of the papers leave the device idle while the host queues them. Here a phase's
steps all have the shape of a few *widths*:

* the group's clients are stacked **longest first** (by their step counts), so the clients still training at step
  ``t`` are a prefix of the stack; the step runs the smallest width of the ladder ``K, ⌈K/√2⌉, ⌈⌈K/√2⌉/√2⌉, …, 1``
  that covers them (at most √2 times the live rows, about 2·log2(K) widths per phase);
* every row's batch is padded to the step's batch width, the smallest of the ladder ``B, ⌈B/√2⌉, …, 1`` that covers
  its rows' largest batch (the batch size, but for the steps that only take epochs' short last batches): a
  ``[width, batch width]`` index into the round's samples and a ``[width]`` count of its real samples (0: a client
  that has finished, or a row of the width beyond the live ones);
* the cross-entropy of a row is the sum over its real samples over their count (the sequential loop's batch mean),
  and the optimizer's update of a row with no real sample is multiplied by 0: its parameters, momentum and loss stay
  exactly as they are.

On a CUDA device the step of each (width, batch width) is captured once as a CUDA graph (after one eager step of that
shape on a side stream: the warm-up the capture needs is a real step) and replayed for every later step of that shape,
with the step's indices and counts copied into the graph's input buffers; the host then does two launches a step.
Anywhere else (a CPU) the same masked steps run eagerly: that is how CI checks them against the sequential loop.

What each client trains beside the model (FedRoD's personal head, FedDBE's representation bias and running mean, APFL's
second model and its weight, pFedMe's personalized model: :class:`~fedskew.engine.batched_rows.Beside`) rides in buffers
of its own, its losses over the real samples only and its update masked as the model's is; so do a per-sample loss
term's frozen models and mask (MOON, FedNTD, FedProto, FedProc, FPL, FedPAC: ``BatchedStep.term_per_sample``), the
term's function part of the shape, a statistic of each batch over its real samples (FedDecorr's decorrelation:
``BatchedStep.term_padded``, a :class:`~fedskew.client.batched_form.PaddedTerm`), the last epoch's class sums over the
real samples (FedProto, FedProc, FPL), FedGen's inputs drawn per client and step (computed for the step's rows before
it), the inner steps of Per-FedAvg (each slice of a row's batch a mask over the padded batch) and pFedMe (θ's rows
solved at every step; BatchNorm's statistics moved by the first pass on the batch, as the bucketed loop moves them,
the later passes each over its own slice on copies), and a client's own term by its stacked form over the real
samples, through a composite head's own stacked form, with the received entries it reads in buffers, its decay of
some parameters and its head's draws for each row's real samples from its client's stream before each step (GPFL,
FedCP). What this form does not cover,
:func:`capture_refusal` names, and the bucketed loop runs: loss terms computed per client without a masked form,
and models without a stacked form (``vmap``: a residual network). BatchNorm's batch statistics are each client's over
its real samples (``stacked.masked_batch_norm``); a second pass on the batch (SAM's, an inner step's, APFL's mixture)
leaves the running statistics as the first pass moved them.
The rows a phase starts from, the shape its graphs bake in and its result are :mod:`fedskew.engine.padded_shape`'s.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep, GeneratedTerm, HeadDraw, padded_mean
from fedskew.engine.batched_schedule import Schedule
from fedskew.engine.batched_steps import Flat, padded_envelope_gradient, padded_inner_gradient, sam_ascent
from fedskew.engine.graph_replay import StepReplay
from fedskew.engine.padded_plan import PaddedPlan
from fedskew.engine.padded_shape import PaddedResult, PaddedRows, PaddedShape, shape_of
from fedskew.engine.stacked import own_form, stackable
from fedskew.engine.stacked_step import (
    ENV_THETA,
    MIX_ALPHA,
    MIX_V,
    REPR_BIAS,
    REPR_RUNNING,
    SIDE_BIAS,
    SIDE_WEIGHT,
    stacked_step_function,
)

if TYPE_CHECKING:
    from fedskew.client.local import TrainSettings


def capture_refusal(rule: BatchedStep, model: nn.Module) -> str | None:
    """Why the steps of ``rule`` on ``model`` cannot run at one shape (:mod:`fedskew.engine.captured`); ``None`` when
    they can."""
    why = stackable(model.body) or stackable(model.head)
    if why is not None:
        return f"the model has no stacked form ({why})"
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    # a module with its own stacked form reads its buffers (and its children's) as inputs and writes none
    inputs = {id(m) for top in model.modules() if own_form(top) for m in top.modules()}
    for name, module in model.named_modules():
        if module not in norms and id(module) not in inputs and any(True for _ in module.buffers(recurse=False)):
            return f"the model has buffers other than BatchNorm's statistics ({name or type(module).__name__})"
    return form_capture_refusal(rule)


def form_capture_refusal(rule: BatchedStep) -> str | None:
    """The part of :func:`capture_refusal` that reads the client part's batched form alone (whatever the model): what
    ``fedskew methods NAME`` says of ``--capture-steps``."""
    if rule.client_term is not None and not rule.client_term_stacked:
        return "the client part's own term has no stacked form (it is computed one client at a time, under vmap)"
    if rule.term is not None and not (rule.term_per_sample or rule.term_padded):
        return "the client part's loss term (one per client that does not read which samples are real) is not masked"
    if rule.inner is not None or rule.envelope is not None:
        others = (rule.term, rule.logits, rule.side_head, rule.representation, rule.mixture, rule.collect, rule.blend)
        own = (rule.client_term, rule.decay, rule.head_draw)
        if rule.sam_rho > 0 or any(t is not None for t in (*others, *own)):
            return "inner steps (Per-FedAvg, pFedMe) run beside no other per-step part at one shape"
    if rule.sam_rho > 0 and any(t is not None for t in (rule.side_head, rule.representation, rule.mixture)):
        return "SAM's second pass would have to carry what the client trains beside the model"
    return None


class PaddedSteps:
    """One shape of phase (:class:`PaddedShape`): its buffers, kept across rounds, and its step at each (width, batch
    width), captured once per such shape on a CUDA device (:class:`StepReplay`). :meth:`run` copies a phase's rows
    into the buffers, runs its steps and returns the trained rows; the graphs read and write only these buffers, so
    the next round of the same shape replays them."""

    def __init__(self, model: nn.Module, shape: PaddedShape, device: torch.device, conv: str = "grouped") -> None:
        self.shape = shape
        k, f32 = shape.rows, shape.dtypes[0]

        def zeros(*size: int, dtype: torch.dtype = f32) -> Tensor:
            return torch.zeros(size, dtype=dtype, device=device)

        self.flat = Flat(list(shape.names), [torch.Size(s) for s in shape.shapes])
        self.p = zeros(k, shape.dim)
        self.fix = {name: zeros(k, *size, dtype=dtype) for name, size, dtype in shape.fixed}
        self.anchor = zeros(k, shape.dim) if shape.anchor else None
        self.shift = zeros(k, shape.dim) if shape.shift is not None else None
        self.pull = None
        if shape.pull is not None:
            self.pull = (zeros(k), zeros(k, shape.dim), zeros(k, shape.dim) if shape.pull[0] else None)
        self.buf = zeros(k, shape.dim) if shape.momentum != 0 else None
        self.logit_map = tuple(None if c is None else zeros(k, c) for c in shape.logit_map)
        self.blend_dir = zeros(k, shape.dim) if shape.blend is not None and shape.blend[1] else None
        self.beside = {key: zeros(k, *size, dtype=dtype) for key, size, dtype in shape.beside}
        sizes = {key: size for key, size, _ in shape.beside}
        self.target = zeros(*sizes[REPR_RUNNING]) if shape.represent is not None and shape.represent[1] else None
        self.loss = zeros(k, dtype=torch.float64)
        self.arange = torch.arange(shape.batch, device=device)
        self.inputs: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]] = {}  # (width, batch) -> x, y, count
        self.frozen = {m: {key: zeros(k, *size, dtype=dtype) for key, size, dtype in keys} for m, keys in shape.frozen}
        self.term_mask = zeros(k) if shape.term_mask else None
        # class sums from each row's ``start`` step on (its last epoch), the step's index ``t`` on the device; the sums'
        # width is the body's output, known at the first step (an eager one: a CUDA warm-up)
        self.start = zeros(k, dtype=torch.int64) if shape.collect is not None else None
        self.t = torch.zeros((), dtype=torch.int64, device=device) if shape.collect is not None else None
        self.classes = torch.arange(shape.collect or 0, device=device)
        self.counts = zeros(k, shape.collect, dtype=torch.float64) if shape.collect is not None else None
        self.sums: Tensor | None = None
        self.drawn: tuple[Tensor, ...] | None = None  # FedGen's inputs of the step's rows, sized at the first step
        self.reads = {key: zeros(k, *size, dtype=dtype) for key, size, dtype in shape.reads}  # a client term's
        self.head_draws: Tensor | None = None  # FedCP's draws of the step's rows [K, B, ...], sized at the first step
        self.decay = None  # [D]: per trained value, the μ of μ·θ added to its gradient (GPFL)
        if shape.decay is not None:
            pieces = zip(shape.shapes, shape.decay, strict=True)
            self.decay = torch.cat([torch.full((math.prod(size),), mu, dtype=f32) for size, mu in pieces]).to(device)
        self.forward = stacked_step_function(
            model,
            list(shape.names),
            shape.mu,
            term=shape.term,
            head_term=shape.generated,
            conv=conv,
            precision=shape.precision,
            client_term=shape.client_term,
            head_draw=shape.head_draw,
        )
        self.buffers = [n for n, _ in model.named_buffers() if n in self.fix]  # BatchNorm's statistics, if any
        self.replay = StepReplay(self._step, device)

    def _inputs(self, key: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
        if key not in self.inputs:
            dev, (_, fx, fy), (w, b) = self.p.device, self.shape.dtypes, key
            self.inputs[key] = (
                torch.zeros((w * b, *self.shape.x), dtype=fx, device=dev),
                torch.zeros(w * b, dtype=fy, device=dev),
                torch.zeros(w, dtype=torch.int64, device=dev),
            )
        return self.inputs[key]

    def _step(self, key: Hashable) -> None:
        sh, (w, b) = self.shape, key  # type: ignore[misc]
        x, y, count = self.inputs[key]  # type: ignore[index]
        live = (count > 0).to(self.p.dtype).unsqueeze(1)  # [w, 1]: rows with a batch at this step
        weights = (self.arange[:b] < count.unsqueeze(1)).to(self.p.dtype)
        denom = count.clamp(min=1).to(self.p.dtype)
        p_w = self.p[:w]
        state = {**self.flat.views(p_w), **{k: v[:w] for k, v in self.fix.items()}}
        anchor = self.flat.views(self.anchor[:w]) if self.anchor is not None else {}
        xs, ys = x.view(w, b, *sh.x), y.view(w, b)
        scale, shift = (None if m is None else m[:w] for m in self.logit_map)
        mapped = None if scale is None and shift is None else (scale, shift)
        extra = self._beside_args(w)
        if self.drawn is not None:  # a row past its last step reads its last draw; its update is masked out
            extra["drawn"] = tuple(d[:w] for d in self.drawn)
        if self.reads:  # the client term's rows of the received entries
            extra["reads"] = {key: v[:w] for key, v in self.reads.items()}
        if self.head_draws is not None:  # the heads' draws of the step's real samples (1 in a padding slot)
            extra["head_draws"] = self.head_draws[:w, :b]
        if sh.term is not None:  # the frozen models' rows and the term's mask
            frozen = {m: {key: v[:w] for key, v in st.items()} for m, st in self.frozen.items()}
            extra["rows"] = (frozen, None if self.term_mask is None else self.term_mask[:w])
        feats = None
        if sh.inner is not None:  # Per-FedAvg: the direction through an inner step, each slice a mask
            grads, loss = padded_inner_gradient(
                self.forward, state, list(sh.names), xs, ys, count, sh.inner, weights, self.buffers
            )
        elif sh.envelope is not None:  # pFedMe: θ's rows solved on the batch (in place), the model pulled to them
            theta = self.beside[ENV_THETA][:w]
            grads, loss = padded_envelope_gradient(
                self.forward, state, self.flat, xs, ys, (weights, denom), sh.envelope, theta, live, self.buffers
            )
        else:
            grads, (loss, _, feats) = self.forward(
                state, {}, anchor, xs, ys, padding=(weights, denom), logit_map=mapped, real=weights, **extra
            )
        if sh.sam_rho > 0:  # the gradient at w + ε (a row without a batch has g = 0, so ε = 0), w restored
            with torch.no_grad():
                eps = torch.cat([e.reshape(w, -1) for e in sam_ascent([grads[n] for n in sh.names], sh.sam_rho)], 1)
                p_w.add_(eps)
                kept = [self.fix[n][:w].clone() for n in self.buffers]  # SAM's frozen BatchNorm statistics
            grads, _ = self.forward(
                state, {}, anchor, xs, ys, padding=(weights, denom), logit_map=mapped, real=weights, **extra
            )
            with torch.no_grad():
                p_w.sub_(eps)
                for n, v in zip(self.buffers, kept, strict=True):
                    self.fix[n][:w].copy_(v)
        with torch.no_grad():
            g = torch.cat([grads[n].reshape(w, -1) for n in sh.names], dim=1)
            if self.decay is not None:  # after_backward: μ·θ added to the decayed tensors' gradients (GPFL)
                g.addcmul_(p_w, self.decay)
            if sh.blend is not None:  # share·g + (1 − share)·Δ; a row without a batch is masked out below
                g = g * sh.blend[0]
                if self.blend_dir is not None:
                    g = g.add(self.blend_dir[:w], alpha=1.0 - sh.blend[0])
            if self.pull is not None and sh.pull is not None:  # grad += α(θ − anchor) − linear, then the norm clip
                alpha, p_anchor, linear = self.pull
                g.add_(alpha[:w].unsqueeze(1) * (p_w - p_anchor[:w]))
                if linear is not None:
                    g.sub_(linear[:w])
                if sh.pull[1] > 0:
                    g.mul_((sh.pull[1] / (torch.linalg.vector_norm(g, dim=1, keepdim=True) + 1e-6)).clamp(max=1.0))
            # each pass below reads and writes the [w, D] rows once; a row without a batch (live 0) keeps its
            # parameters and momentum exactly: b·1 + g·0 = b, p + (−lr)·b·0 = p
            if sh.weight_decay != 0:
                g.add_(p_w, alpha=sh.weight_decay)
            if self.buf is not None:
                b_w = self.buf[:w]
                b_w.mul_(torch.where(live > 0, sh.momentum, 1.0)).addcmul_(g, live)  # live rows: b·β + g
                g = b_w
            p_w.addcmul_(g, live, value=-sh.lr)
            if self.shift is not None and sh.shift is not None:  # SCAFFOLD's after_step, outside the optimizer
                p_w.addcmul_(self.shift[:w], live, value=sh.shift)
            if self.beside and feats is not None:
                self._advance_beside(w, live, grads, padded_mean(feats, (weights, denom)))
            if self.counts is not None and self.start is not None and self.t is not None:
                # each row's real samples in its last epoch
                on = (self.start[:w] <= self.t).to(torch.float64).view(w, 1, 1)
                onehot = (ys.unsqueeze(-1) == self.classes).to(torch.float64) * weights.to(torch.float64).unsqueeze(-1)
                onehot = onehot * on  # [w, b, C]
                if self.sums is None:
                    self.sums = torch.zeros(
                        (sh.rows, *self.counts.shape[1:], feats.shape[-1]), dtype=torch.float64, device=feats.device
                    )
                self.sums[:w] += torch.einsum("rbc,rbd->rcd", onehot, feats.to(torch.float64))
                self.counts[:w] += onehot.sum(1)
            self.loss[:w] += (loss * count).double()

    @torch.no_grad()
    def _draw(self, generated: tuple[GeneratedTerm, tuple[Tensor, ...]], at: Tensor) -> None:
        """The step's rows of FedGen's inputs (``at``: their rows of the schedule's draws) into the step's buffers,
        computed eagerly (the round's generator is not a buffer of the graphs), as the bucketed loop computes them."""
        term, draws = generated
        outs = term.inputs(*(d.index_select(0, at) for d in draws))
        outs = outs if isinstance(outs, tuple) else (outs,)
        if self.drawn is None:
            k = self.shape.rows
            self.drawn = tuple(torch.zeros((k, *o.shape[1:]), dtype=o.dtype, device=o.device) for o in outs)
        for buf, o in zip(self.drawn, outs, strict=True):
            buf[: o.shape[0]].copy_(o)

    @torch.no_grad()
    def _draw_heads(self, draws: list[HeadDraw], plan: PaddedPlan, t: int, w: int, b: int) -> None:
        """Step ``t``'s draws of the heads (FedCP's ``Exp(1)`` noise) into the step's buffer: each row with a batch
        draws for its real samples from its client's own stream, in its step order, as the sequential forward draws
        them; a padding slot holds 1 (its noise ``−log 1 = 0``; its loss is selected out)."""
        made = [(r, draws[int(plan.order[r])].draw(int(c))) for r, c in enumerate(plan.count_host[t, :w]) if c > 0]
        if not made:
            return
        if self.head_draws is None:
            first = made[0][1]
            size = (self.shape.rows, self.shape.batch, *first.shape[1:])
            self.head_draws = torch.ones(size, dtype=first.dtype, device=first.device)
        self.head_draws[:w, :b].fill_(1.0)
        for r, drawn in made:
            self.head_draws[r, : drawn.shape[0]].copy_(drawn)

    def _beside_args(self, w: int) -> dict[str, object]:
        """The step's ``side``, ``represent`` and ``mixture`` arguments (:func:`stacked_step_function`) from the
        first ``w`` rows of the buffers."""
        rows, out = {key: v[:w] for key, v in self.beside.items()}, {}
        if SIDE_WEIGHT in rows:
            out["side"] = (rows[SIDE_WEIGHT], rows[SIDE_BIAS])
        if self.shape.represent is not None:
            momentum, _, weight = self.shape.represent
            out["represent"] = (rows.get(REPR_BIAS), rows[REPR_RUNNING], momentum, self.target, weight)
        if MIX_V in rows:
            out["mixture"] = (self.flat.views(rows[MIX_V]), rows[MIX_ALPHA])
        return out

    def _advance_beside(self, w: int, live: Tensor, grads: dict[str, Tensor], mean: Tensor) -> None:
        """What the clients train beside the model after the step, as :meth:`Beside.advance` does, a row without a
        batch kept exactly: plain SGD at the run's learning rate (such a row's gradient is exactly 0, every loss on it
        selected out, and no momentum or decay moves it), FedDBE's running mean from the batch's mean over its real
        samples (``mean`` ``[w, d]``) and APFL's ``α`` (whose l2 term would move it) on the live rows only."""
        sh, rows = self.shape, {key: v[:w] for key, v in self.beside.items()}
        for key in (SIDE_WEIGHT, SIDE_BIAS, REPR_BIAS):
            if key in rows:
                rows[key].sub_(grads[key], alpha=sh.beside_lr)
        if sh.represent is not None:
            running, m = rows[REPR_RUNNING], sh.represent[0]
            running.copy_(torch.where(live > 0, (1 - m) * running + m * mean, running))
        if sh.mixture is not None:
            rows[MIX_V].sub_(torch.cat([grads[MIX_V + n].reshape(w, -1) for n in sh.names], dim=1), alpha=sh.beside_lr)
            if sh.mixture[0]:  # α ← clip(α − lr·(∂α + l2·α), 0, 1)
                alpha = rows[MIX_ALPHA]
                new = alpha.sub(grads[MIX_ALPHA] + sh.mixture[1] * alpha, alpha=sh.beside_lr).clamp(0.0, 1.0)
                alpha.copy_(torch.where(live[:, 0] > 0, new, alpha))

    def run(self, plan: PaddedPlan, x_all: Tensor, y_all: Tensor, given: PaddedRows) -> PaddedResult:
        """The phase's steps from ``given``'s rows, their result in client order, in new tensors (the buffers are the
        next round's)."""
        order = torch.as_tensor(plan.order, device=self.p.device)

        def load(mine: Tensor | None, rows: Tensor | None) -> None:
            if mine is not None and rows is not None:
                mine.copy_(rows.index_select(0, order))

        with torch.no_grad():
            load(self.p, given.params)
            for k, v in given.fixed.items():
                load(self.fix[k], v)
            load(self.anchor, given.anchor)
            load(self.shift, None if given.shift is None else given.shift[0])
            load(self.blend_dir, None if given.blend is None else given.blend[1])
            if self.pull is not None and given.pull is not None:
                for mine, rows in zip(self.pull, given.pull, strict=True):
                    load(mine, rows)
            for mine, rows in zip(self.logit_map, given.logit_map or (None, None), strict=True):
                load(mine, rows)
            for key, rows in given.beside_rows.items():
                load(self.beside[key], rows)
            for key, rows in given.reads.items():
                load(self.reads[key], rows)
            if self.target is not None and given.beside is not None and given.beside.target is not None:
                self.target.copy_(given.beside.target)
            if given.term is not None:
                for m, state in given.term[1].items():
                    for key, rows in state.items():
                        load(self.frozen[m][key], rows)
                load(self.term_mask, given.term[2])
            if self.counts is not None and given.collect is not None:
                load(self.start, given.collect[1])
                self.counts.zero_()
                if self.sums is not None:
                    self.sums.zero_()
            if self.buf is not None:
                self.buf.zero_()  # 0·β + g = g exactly: the first step's buf = g
            self.loss.zero_()
        for t, (w, b) in enumerate(plan.shapes):
            x, y, count = self._inputs((w, b))
            idx = plan.index[t, :w, :b].reshape(-1)
            torch.index_select(x_all, 0, idx, out=x)
            torch.index_select(y_all, 0, idx, out=y)
            count.copy_(plan.count[t, :w])
            if given.generated is not None and plan.drawn is not None:
                self._draw(given.generated, plan.drawn[t, :w])
            if given.head_draws:
                self._draw_heads(given.head_draws, plan, t, w, b)
            if self.t is not None:
                self.t.fill_(t)
            self.replay((w, b))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        rows = {key: v.index_select(0, back) for key, v in self.beside.items()}
        sums = None if self.sums is None else self.sums.index_select(0, back)
        counts = None if self.counts is None else self.counts.index_select(0, back)
        fixed = {key: self.fix[key].index_select(0, back) for key in self.buffers}  # the buffers (BatchNorm: moved)
        return PaddedResult(self.p.index_select(0, back), self.loss.index_select(0, back), rows, sums, counts, fixed)


class PaddedCache:
    """The :class:`PaddedSteps` of the shapes a run's phases have had (at most ``size``, the least recently used
    dropped): a batched trainer keeps one, so that every round of the same shape replays the same graphs. A shape's
    steps are kept per form of the stacked convolutions (:data:`~fedskew.engine.stacked.CONV_FORMS`). A shape that
    differs from a kept one by its loss terms' functions alone replaces it: a term built anew each round (one reading
    its round's prototypes) would otherwise fill the cache with the buffers of rounds that do not come back."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.steps: OrderedDict[tuple[PaddedShape, str], PaddedSteps] = OrderedDict()

    def get(self, model: nn.Module, shape: PaddedShape, device: torch.device, conv: str = "grouped") -> PaddedSteps:
        found = self.steps.pop((shape, conv), None)
        if found is None:
            family = replace(shape, term=None, generated=None)
            stale = [k for k in self.steps if k[1] == conv and replace(k[0], term=None, generated=None) == family]
            for key in stale:
                del self.steps[key]
            found = PaddedSteps(model, shape, device, conv)
        self.steps[(shape, conv)] = found
        while len(self.steps) > self.size:
            self.steps.popitem(last=False)
        return found


def run_padded(
    model: nn.Module,
    rule: BatchedStep,
    settings: TrainSettings,
    lr: float,
    mu: float,
    flat: Flat,
    sched: Schedule,
    x_all: Tensor,
    y_all: Tensor,
    given: PaddedRows,
    cache: PaddedCache | None = None,
    conv: str = "grouped",
) -> PaddedResult:
    """One phase of the group's training at the ladder's widths from ``given``'s stacked rows (:class:`PaddedRows`,
    client order): the trained ``[K, D]`` rows and each client's summed ``batch loss × batch size`` (float64), in
    client order, as the bucketed loop returns them, with the rows trained beside the model and the class sums when
    the form has them. ``cache``: where the phase's buffers and graphs are kept for the next round of the same shape
    (``None``: this phase only)."""
    plan = PaddedPlan(sched, int(sched.bs.max(initial=1)), given.params.device)
    shape = shape_of(rule, settings, lr, mu, flat, plan, x_all, y_all, given)
    steps = (cache if cache is not None else PaddedCache()).get(model, shape, given.params.device, conv)
    return steps.run(plan, x_all, y_all, given)
