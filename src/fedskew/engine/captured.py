"""Batched steps at one shape, so that a CUDA device can replay each step as one captured graph.

The bucketed step loop of :mod:`fedskew.engine.batched` is exact without padding, but its shapes change from step to
step (a client's short last batch, clients that finish early), and every step launches its few hundred kernels from
Python: on a GPU the small models of the papers leave the device idle while the host queues them. Here a phase's
steps all have the shape of a few *widths*:

* the group's clients are stacked **longest first** (by their step counts), so the clients still training at step
  ``t`` are a prefix of the stack; the step runs the smallest width of the ladder ``K, ⌈K/2⌉, ⌈K/4⌉, …, 1`` that
  covers them (at most twice the live rows, a handful of widths per phase);
* every row's batch is padded to the batch size: a ``[width, B]`` index into the round's samples and a ``[width]``
  count of its real samples (0: a client that has finished, or a row of the width beyond the live ones);
* the cross-entropy of a row is the sum over its real samples over their count (the sequential loop's batch mean),
  and the optimizer's update of a row with no real sample is multiplied by 0: its parameters, momentum and loss stay
  exactly as they are.

On a CUDA device the step of each width is captured once as a CUDA graph (after one eager step of that width on a side
stream: the warm-up the capture needs is a real step) and replayed for every later step of that width, with the step's
indices and counts copied into the graph's input buffers; the host then does two launches a step. Anywhere else (a
CPU) the same masked steps run eagerly: that is how CI checks them against the sequential loop.

What this form does not cover, :func:`capture_refusal` names, and the bucketed loop runs: BatchNorm (its statistics
over a padded batch), loss terms against frozen models or generated inputs, class sums collected during training,
and models without a stacked form (``vmap``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep
from fedskew.engine.batched_schedule import Schedule, upload_index
from fedskew.engine.batched_steps import Flat
from fedskew.engine.stacked import stackable, stacked_step_function

if TYPE_CHECKING:
    from fedskew.client.local import TrainSettings


def capture_refusal(rule: BatchedStep, model: nn.Module) -> str | None:
    """Why the steps of ``rule`` on ``model`` cannot run at one shape (:mod:`fedskew.engine.captured`); ``None`` when
    they can."""
    why = stackable(model.body) or stackable(model.head)
    if why is not None:
        return f"the model has no stacked form ({why})"
    if any(True for _ in model.buffers()):
        return "the model has buffers (BatchNorm statistics would be computed over padded batches)"
    if rule.has_term:
        return "the client part's loss term (frozen models, generated inputs or collected class sums) is not masked"
    return None


def ladder(k: int) -> list[int]:
    """The widths a phase of ``k`` clients runs at: ``k, ⌈k/2⌉, ⌈k/4⌉, …, 1``, largest first."""
    out = [k]
    while out[-1] > 1:
        out.append(-(-out[-1] // 2))
    return out


def step_widths(steps: np.ndarray) -> list[int]:
    """Per step ``t`` of clients taking ``steps`` steps each, the width it runs at: the smallest of :func:`ladder`
    covering the clients with ``steps > t`` (their sum over the steps against ``steps.sum()`` is the padding's cost)."""
    widths = ladder(int(steps.size))
    live = [int((steps > t).sum()) for t in range(int(steps.max(initial=0)))]
    return [min(w for w in widths if w >= n) for n in live]


class PaddedPlan:
    """A phase's steps at the ladder's widths: ``order`` the group positions longest first (row r of the stack is
    client ``order[r]``), per step its width, and on the device the ``[T, K, B]`` sample indices and ``[T, K]``
    counts of real samples (0 beyond a row's steps)."""

    def __init__(self, sched: Schedule, batch: int, device: torch.device) -> None:
        k = int(sched.n.size)
        self.order = np.argsort(-sched.steps, kind="stable")
        rank = np.empty(k, dtype=np.int64)
        rank[self.order] = np.arange(k)
        total = int(sched.steps.max(initial=0))
        index = np.zeros((total, k, batch), dtype=np.int64)
        count = np.zeros((total, k), dtype=np.int64)
        for t in range(total):
            for size, rows, idx in sched.at(t):
                index[t, rank[rows], :size] = idx
                count[t, rank[rows]] = size
        self.widths = step_widths(sched.steps)
        self.batch = batch
        self.index = upload_index(index, device)
        self.count = upload_index(count, device)


class StepReplay:
    """Runs ``step(width)`` for each step: on a CUDA device each width's step captured as a CUDA graph on its second
    use (its first runs eagerly on a side stream: the warm-up the capture needs) and replayed after; elsewhere eagerly.
    A capture that fails warns with the reason and the phase goes on eagerly (the step reads and writes only the
    buffers it is given, so an eager step and a replay do the same)."""

    def __init__(self, step: Callable[[int], None], device: torch.device) -> None:
        self.step = step
        self.capture = device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.warm: set[int] = set()
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def __call__(self, width: int) -> None:
        if not self.capture:
            self.step(width)
            return
        graph = self.graphs.get(width)
        if graph is not None:
            graph.replay()
            return
        if width not in self.warm:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step(width)
            torch.cuda.current_stream().wait_stream(side)
            self.warm.add(width)
            return
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                self.step(width)
        except RuntimeError as err:  # pragma: no cover - needs a CUDA device
            warnings.warn(f"batched step capture failed ({err}); running the steps eagerly", stacklevel=2)
            self.capture = False
            self.step(width)
            return
        self.graphs[width] = graph
        graph.replay()  # the capture recorded the step without running it


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
    params: Tensor,
    fixed: dict[str, Tensor],
    anchor: Tensor | None,
    shift: tuple[Tensor, float] | None,
    pull: tuple[Tensor, Tensor, Tensor | None] | None,
) -> tuple[Tensor, Tensor]:
    """One phase of the group's training at the ladder's widths from the stacked ``params`` ``[K, D]`` (client order;
    ``fixed``: the other entries of their state dicts, ``[K, ...]``): the trained ``[K, D]`` rows and each client's
    summed ``batch loss × batch size`` (float64), in client order, as the bucketed loop returns them. ``anchor``:
    FedProx's received rows; ``shift``: SCAFFOLD's ``(c − c_i rows, scale)`` after each step; ``pull``: FedDyn's
    ``(α [K], anchor rows, linear rows or None)`` on the gradient, clipped by ``rule.clip``."""
    device = params.device
    plan = PaddedPlan(sched, int(sched.bs.max(initial=1)), device)
    order = torch.as_tensor(plan.order, device=device)

    def rows(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.index_select(0, order).contiguous()

    p = rows(params)
    assert p is not None
    fix = {k: v.index_select(0, order).contiguous() for k, v in fixed.items()}
    anc, sh = rows(anchor), rows(shift[0]) if shift is not None else None
    pull_rows = None if pull is None else (rows(pull[0]), rows(pull[1]), rows(pull[2]))
    buf = torch.zeros_like(p) if settings.momentum != 0 else None  # 0·β + g = g exactly: the first step's buf = g
    loss_sum = torch.zeros(p.shape[0], dtype=torch.float64, device=device)
    forward = stacked_step_function(model, flat.names, mu)
    arange = torch.arange(plan.batch, device=device)
    inputs = {
        w: (
            torch.zeros((w, plan.batch), dtype=torch.int64, device=device),
            torch.zeros(w, dtype=torch.int64, device=device),
        )
        for w in set(plan.widths)
    }

    def step(w: int) -> None:
        idx, count = inputs[w]
        live = (count > 0).to(p.dtype).unsqueeze(1)  # [w, 1]: rows with a batch at this step
        weights = (arange < count.unsqueeze(1)).to(p.dtype)
        denom = count.clamp(min=1).to(p.dtype)
        p_w = p[:w]
        state = {**flat.views(p_w), **{k: v[:w] for k, v in fix.items()}}
        grads, (loss, _, _) = forward(
            state, {}, flat.views(anc[:w]) if anc is not None else {}, x_all[idx], y_all[idx], padding=(weights, denom)
        )
        with torch.no_grad():
            g = torch.cat([grads[n].reshape(w, -1) for n in flat.names], dim=1)
            if pull_rows is not None:  # grad += α(θ − anchor) − linear, then the client's norm clip
                alpha, p_anchor, linear = pull_rows
                g = g + alpha[:w].unsqueeze(1) * (p_w - p_anchor[:w])
                if linear is not None:
                    g = g - linear[:w]
                if rule.clip > 0:
                    g = g * (rule.clip / (torch.linalg.vector_norm(g, dim=1, keepdim=True) + 1e-6)).clamp(max=1.0)
            # each pass below reads and writes the [w, D] rows once; a row without a batch (live 0) keeps its
            # parameters and momentum exactly: b·1 + g·0 = b, p + (−lr)·b·0 = p
            if settings.weight_decay != 0:
                g.add_(p_w, alpha=settings.weight_decay)
            if buf is not None:
                b_w = buf[:w]
                b_w.mul_(torch.where(live > 0, settings.momentum, 1.0)).addcmul_(g, live)  # live rows: b·β + g
                g = b_w
            p_w.addcmul_(g, live, value=-lr)
            if sh is not None:  # SCAFFOLD's after_step, outside the optimizer
                p_w.addcmul_(sh[:w], live, value=shift[1])  # type: ignore[index]
            loss_sum[:w] += (loss * count).double()

    replay = StepReplay(step, device)
    for t, w in enumerate(plan.widths):
        idx, count = inputs[w]
        idx.copy_(plan.index[t, :w])
        count.copy_(plan.count[t, :w])
        replay(w)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=device)
    return p.index_select(0, back), loss_sum.index_select(0, back)
