"""The shapes a phase of batched clients runs at when every step is captured (:mod:`fedskew.engine.captured`): the
clients stacked longest first, each step at the smallest width of a √2 ladder covering the clients still training,
every row's batch padded to the smallest batch width of a second ladder covering its largest real batch, and the
``[T, K, B]`` sample indices and ``[T, K]`` counts of real samples that drive the masked steps."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedskew.engine.batched_schedule import Schedule, upload_index

if TYPE_CHECKING:
    from torch import Tensor

    from fedskew.client.local import TrainSettings


# each width of a ladder over the next: √2 pads a step to at most √2 times its live rows (halves: 2×) for about twice
# as many widths, each captured once; on issue 15's Dirichlet round it takes the sample slots from 1.35× the real
# samples (halves) to 1.13× (docs/design.md)
LADDER_RATIO = 2**0.5


def ladder(k: int) -> list[int]:
    """The widths a phase of ``k`` clients runs at: ``k``, then each ``⌈previous/√2⌉`` (at least one less) down to 1,
    largest first."""
    out = [k]
    while out[-1] > 1:
        out.append(min(out[-1] - 1, math.ceil(out[-1] / LADDER_RATIO)))
    return out


def step_batches(count: np.ndarray, batch: int) -> list[int]:
    """Per step (``count``: ``[T, K]`` real samples of each row at each step), the batch width it runs at: the smallest
    of :func:`ladder` of ``batch`` covering its largest real batch (every real sample runs; a step of epochs' short
    last batches alone runs narrower)."""
    widths = ladder(batch)
    return [min(w for w in widths if w >= int(n)) for n in count.max(axis=1, initial=1)]


def step_widths(steps: np.ndarray) -> list[int]:
    """Per step ``t`` of clients taking ``steps`` steps each, the width it runs at: the smallest of :func:`ladder`
    covering the clients with ``steps > t`` (their sum over the steps against ``steps.sum()`` is the padding's cost)."""
    widths = ladder(int(steps.size))
    live = [int((steps > t).sum()) for t in range(int(steps.max(initial=0)))]
    return [min(w for w in widths if w >= n) for n in live]


class PaddedPlan:
    """A phase's steps at the ladders' shapes: ``order`` the group positions longest first (row r of the stack is
    client ``order[r]``), per step its width and batch width (``shapes``), and on the device the ``[T, K, B]`` sample
    indices and ``[T, K]`` counts of real samples (0 beyond a row's steps)."""

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
        self.shapes = list(zip(self.widths, step_batches(count, batch), strict=True))  # per step (width, batch width)
        self.batch = batch
        self.index = upload_index(index, device)
        self.count = upload_index(count, device)
        self.count_host = count  # the same counts on the host (the draws of FedCP's heads, per row and step)
        # FedGen's inputs drawn per client and step: row r's at step t is its client's row drawn_base + t, past its
        # last step its last one (a row whose update is masked out then)
        self.drawn: Tensor | None = None
        if sched.drawn is not None and sched.drawn_base is not None and total > 0:
            last = np.maximum(sched.steps[self.order] - 1, 0)
            at = sched.drawn_base[self.order][None, :] + np.minimum(np.arange(total)[:, None], last[None, :])
            self.drawn = upload_index(np.minimum(at, int(sched.drawn[0].shape[0]) - 1), device)


def padded_samples(sizes: list[int], settings: TrainSettings) -> tuple[int, int, int]:
    """What the padded steps of one phase of clients with ``sizes`` training samples compute: ``(sample slots, real
    samples, distinct step shapes)``; slots over real samples is padding's cost (:class:`PaddedPlan`'s ladders)."""
    from fedskew.engine.batched_schedule import schedule

    offsets = np.concatenate([[0], np.cumsum(sizes[:-1])]).astype(np.int64).tolist() if sizes else []
    sched = schedule(sizes, offsets, settings, [torch.Generator() for _ in sizes])  # sizes fix the counts, not order
    plan = PaddedPlan(sched, int(sched.bs.max(initial=1)), torch.device("cpu"))
    return sum(w * b for w, b in plan.shapes), int(plan.count.sum()), len(set(plan.shapes))
