"""Clients trained in parallel worker processes, with results identical to the sequential loop.

Why it is exact: a client's local training depends only on what it received (model, broadcast extras), its own
persistent state, its data and its batch order, which comes from a generator keyed by (seed, client, round)
(``fedskew/seeding.py``). None of these depends on which process trains it or on the other clients, so a worker
computes bit for bit what the parent would (same single-threaded CPU kernels), and the parent consumes the results in
the sampled order, so the server sees the uploads in the same order as well.

How: the workers are forked from the parent after the simulation is built, so each holds a copy of the federation's
tensors, the model and the method (user-registered parts included) without pickling them. Per client the parent sends
``(cid, round, received, broadcast, client_state)`` and gets back the upload and the client's new state; the
parent's ``client_states`` stays the one source of truth (checkpoints, resume). Each worker runs torch with one thread.
Fork is the start method DataLoader workers use on Linux; it is not available on Windows or with CUDA tensors, where
``workers > 1`` is refused.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fedskew.protocol import ClientUpdate, Params

if TYPE_CHECKING:
    from fedskew.engine.loop import Simulation

_SIM: Simulation | None = None  # the forked copy of the simulation, in a worker


def _init_worker() -> None:
    torch.set_num_threads(1)


def _train_one(job: tuple[int, int, Params, Params, dict[str, Any]]) -> tuple[ClientUpdate, dict[str, Any]]:
    cid, rnd, received, broadcast, state = job
    assert _SIM is not None
    _SIM.client_states[cid] = state
    update = _SIM._train(cid, rnd, received, broadcast)
    new_state = _SIM.client_states[cid]
    _SIM.client_states[cid] = {}  # the parent holds the state; do not keep a stale copy
    return update, new_state


def can_fork(device: str) -> str | None:
    """Why worker processes cannot be used here (``None``: they can)."""
    if "fork" not in mp.get_all_start_methods():
        return "worker processes need the 'fork' start method, which this platform lacks"
    if torch.device(device).type != "cpu":
        return f"worker processes train on the CPU; device {device!r} trains one client at a time"
    return None


class ClientWorkers:
    """A pool of ``n`` forked processes that train clients of one simulation (see the module docstring)."""

    def __init__(self, sim: Simulation, n: int) -> None:
        why = can_fork(sim.cfg.device)
        if why is not None:
            raise ValueError(why)
        global _SIM
        _SIM = sim  # inherited by the forked workers
        try:
            self._pool = mp.get_context("fork").Pool(n, initializer=_init_worker)
        finally:
            _SIM = None
        self.n = n
        self._owner = os.getpid()

    def train(
        self, sim: Simulation, rnd: int, jobs: Sequence[tuple[int, Params, Params]]
    ) -> Iterator[ClientUpdate]:
        """Train ``(cid, received, broadcast)`` jobs in parallel; yield the uploads in the order of ``jobs``, each
        client's new state already stored in ``sim.client_states``."""
        payload = [(cid, rnd, received, broadcast, sim.client_states[cid]) for cid, received, broadcast in jobs]
        for (cid, _, _), (update, state) in zip(
            jobs, self._pool.imap(_train_one, payload, chunksize=1), strict=True
        ):
            sim.client_states[cid] = state
            yield update

    def close(self) -> None:
        if os.getpid() == self._owner:
            self._pool.terminate()
            self._pool.join()

    def __enter__(self) -> ClientWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
