"""The batch schedule of a round's batched clients (:mod:`fedskew.engine.batched`): every client's batches drawn as
the sequential loop draws them, and the step-by-step plan of buckets and retirements computed on the host before
training, so that the step loop never waits for the device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fedskew.client.local import TrainSettings


@dataclass
class Schedule:
    """Every client's batches: global row indices into the round's concatenated training tensors."""

    order: np.ndarray  # all clients' epoch permutations, offset to global rows, concatenated
    base: np.ndarray  # [K] where client k's permutations start in ``order``
    n: np.ndarray  # [K] training samples
    bs: np.ndarray  # [K] batch size min(batch_size, n)
    nb: np.ndarray  # [K] batches per epoch
    steps: np.ndarray  # [K] epochs · batches per epoch
    # inputs drawn per client and step (FedGen): each drawn tensor's rows, all clients' steps concatenated, and [K]
    # where client k's steps start in them (its step t is row drawn_base[k] + t)
    drawn: tuple[Tensor, ...] | None = None
    drawn_base: np.ndarray | None = None

    def at(self, t: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Step ``t``'s buckets: ``(batch size, client rows, [rows, size] sample indices)`` per distinct size."""
        active = np.nonzero(t < self.steps)[0]
        if active.size == 0:
            return []
        nb, bs, n = self.nb[active], self.bs[active], self.n[active]
        e, b = t // nb, t % nb
        size = np.minimum(bs, n - b * bs)
        start = self.base[active] + e * n + b * bs
        out = []
        for s in np.unique(size):
            sel = size == s
            out.append((int(s), active[sel], self.order[start[sel][:, None] + np.arange(s)]))
        return out


def schedule(
    ns: Sequence[int],
    offsets: Sequence[int],
    settings: TrainSettings,
    generators: Sequence[torch.Generator],
    draw: Callable[[torch.Generator], tuple[Tensor, ...]] | None = None,
) -> Schedule:
    """The clients' batch orders: ``settings.epochs`` permutations per client drawn from its generator in epoch
    order, as ``local_train`` draws them, with the same batch size and count; with ``draw``, also one draw per step
    after its epoch's permutation (the order in which the sequential loop's loss hook draws: FedGen's)."""
    n = np.asarray(ns, dtype=np.int64)
    if (n < 1).any():
        raise ValueError(f"every client needs at least one training sample, got sizes {n.tolist()}")
    layout = [settings.batches(int(k)) for k in n]  # (batch size, batch count) per client, as local_train's
    bs = np.array([b for b, _ in layout], dtype=np.int64)
    nb = np.array([c for _, c in layout], dtype=np.int64)
    parts, draws = [], []
    for n_k, nb_k, off, gen in zip(ns, nb.tolist(), offsets, generators, strict=True):
        for _ in range(settings.epochs):
            parts.append(torch.randperm(n_k, generator=gen).numpy() + off)
            if draw is not None:
                draws.extend(draw(gen) for _ in range(nb_k))
    order = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    base = np.concatenate([[0], np.cumsum(n[:-1] * settings.epochs)]).astype(np.int64)
    steps = nb * settings.epochs
    if draw is None or not draws:
        return Schedule(order, base, n, bs, nb, steps)
    drawn = tuple(torch.stack(column) for column in zip(*draws, strict=True))
    return Schedule(order, base, n, bs, nb, steps, drawn, np.concatenate([[0], np.cumsum(steps[:-1])]))


def upload_index(a: np.ndarray, device: torch.device) -> Tensor:
    """A host array on ``device`` without waiting for the device: a copy from pageable memory would first wait for
    every queued kernel (a stream sync per step); from pinned memory it is queued like a kernel."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class Bucket:
    size: int  # batch size of its clients at this step
    rows: int  # how many clients
    members: slice  # their positions in the group (client order), in the round's index tensor
    sample: slice  # their [rows, size] sample indices, flattened, in the round's index tensor
    pos: slice | None  # their positions among the live rows (None: all of them, in order)
    drawn: slice | None = None  # their rows of the schedule's drawn inputs at this step (FedGen)
    clients: np.ndarray | None = None  # their positions in the group, on the host (a head's draws per client)


@dataclass
class StepPlan:
    keep: np.ndarray | None  # retire first: which live rows stay (None: all)
    sel: slice | None  # their positions, in the round's index tensor
    buckets: list[Bucket]


def plan_steps(sched: Schedule, device: torch.device) -> tuple[list[StepPlan], Tensor]:
    """Every step's retirements and buckets, computed on the host before training, with all their index arrays in
    one tensor uploaded once: the step loop then only slices it and never waits for the device."""
    parts: list[np.ndarray] = []
    used = 0

    def put(a: np.ndarray) -> slice:
        nonlocal used
        parts.append(a.reshape(-1))
        used += a.size
        return slice(used - a.size, used)

    steps: list[StepPlan] = []
    live = np.arange(sched.n.size)
    for t in range(int(sched.steps.max(initial=0)) + 1):  # the last "step" retires everyone
        buckets = sched.at(t)
        active = np.sort(np.concatenate([rows for _, rows, _ in buckets])) if buckets else np.zeros(0, np.int64)
        keep = sel = None
        if active.size < live.size:
            keep = np.isin(live, active)
            sel = put(np.nonzero(keep)[0])
            live = live[keep]
        planned = []
        for size, rows, idx in buckets:
            pos = None if rows.size == live.size else put(np.searchsorted(live, rows))
            drawn = None if sched.drawn_base is None else put(sched.drawn_base[rows] + t)
            planned.append(Bucket(size, int(rows.size), put(rows), put(idx), pos, drawn, rows))
        steps.append(StepPlan(keep, sel, planned))
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return steps, upload_index(flat, device)
