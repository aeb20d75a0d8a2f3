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

Fork safety. A job and its result travel as plain bytes (``torch.save`` into a buffer), never through torch's
shared-memory reducers: those hand file descriptors over a background ``resource_sharer`` thread, and a process
forked while such a thread runs can deadlock (it did once in CI). The parent therefore runs no helper thread of ours
when it forks, the workers never write to the parent's (possibly redirected, e.g. by a rich progress bar) stdout or
stderr, and a worker that dies (out of memory, a crash in native code) stops the run with an error naming the client
instead of leaving it waiting forever (``concurrent.futures``'s broken-pool detection).
"""

from __future__ import annotations

import io
import math
import multiprocessing as mp
import os
import pickle
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedskew.engine.evaluate import batch_scores
from fedskew.lifecycle import die_with_parent
from fedskew.protocol import Params, Upload

if TYPE_CHECKING:
    from fedskew.engine.host import BatchScores, ClientHost, EvalSource, TrainJob

_SIM: ClientHost | None = None  # the forked copy of the simulation, in a worker


# ---- transport: plain bytes, each tensor compacted to its own elements ------------------------------------------
def _rebuild_tensor(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...], kind: str, grad: bool) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    t = flat.view(dtype).reshape(shape) if raw else torch.empty(shape, dtype=dtype)
    if kind == "parameter":
        return nn.Parameter(t, requires_grad=grad)
    return t.requires_grad_(grad) if grad else t


class _Pickler(pickle.Pickler):
    """Pickles CPU tensors as their own bytes: not through torch's shared-memory reducers (which need a background
    fd-passing thread, see the module docstring) and not as their whole storage (a row of a stacked [K, ...] buffer
    travels as one row)."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor or type(obj) is nn.Parameter:
            t = obj.detach()
            flat = t.contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            kind = "parameter" if type(obj) is nn.Parameter else "tensor"
            return _rebuild_tensor, (raw, t.dtype, tuple(t.shape), kind, obj.requires_grad)
        return NotImplemented


def pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def unpack(raw: bytes) -> Any:
    return pickle.loads(raw)


# ---- the worker side ----------------------------------------------------------------------------------------------
def _init_worker(parent: int | None = None) -> None:
    die_with_parent(parent)  # a kill -9 of the run leaves no worker behind
    torch.set_num_threads(1)
    if _SIM is not None:  # the parent's client_states is the one source of truth (a disk store: its files only)
        _SIM.client_states = {}
    # never write into the parent's streams (a progress bar may have replaced them with proxies holding locks)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__


def _train_one(job: bytes) -> bytes:
    cid, rnd, received, broadcast, state = unpack(job)
    assert _SIM is not None
    _SIM.client_states[cid] = state
    update = _SIM._train(cid, rnd, received, broadcast)
    new_state = _SIM.client_states[cid]
    _SIM.client_states[cid] = {}  # the parent holds the state; do not keep a stale copy
    return pack((update, new_state))


def _score_one(job: bytes) -> bytes:
    params, source, start, stop, batch_size = unpack(job)
    assert _SIM is not None
    x, y = _SIM.eval_tensors(source)
    _SIM.model.load_state_dict(params)
    return pack(batch_scores(_SIM.model, x, y, batch_size, start, stop))


def can_fork(device: str) -> str | None:
    """Why worker processes cannot be used here (``None``: they can)."""
    if "fork" not in mp.get_all_start_methods():
        return "worker processes need the 'fork' start method, which this platform lacks"
    if torch.device(device).type != "cpu":
        return f"worker processes train on the CPU; device {device!r} trains one client at a time"
    return None


class WorkerDied(RuntimeError):
    """A worker process ended without returning its client's result (killed, out of memory, crashed)."""


class ClientWorkers:
    """A pool of ``n`` forked processes that train clients of one simulation (see the module docstring)."""

    def __init__(self, sim: ClientHost, n: int) -> None:
        why = can_fork(sim.cfg.device)
        if why is not None:
            raise ValueError(why)
        global _SIM
        _SIM = sim  # inherited by the forked workers
        try:
            self._pool = ProcessPoolExecutor(
                n, mp_context=mp.get_context("fork"), initializer=_init_worker, initargs=(os.getpid(),)
            )
            # with fork, all n processes are started before the pool's own helper threads: start them now, while
            # the simulation is the one to inherit
            self._pool.submit(int).result()
        finally:
            _SIM = None
        self.n = n
        self._owner = os.getpid()

    def train(self, sim: ClientHost, rnd: int, jobs: Sequence[TrainJob]) -> Iterator[Upload]:
        """Train ``(cid, received, broadcast)`` jobs in parallel; yield the uploads in the order of ``jobs``, each
        client's new state already stored in ``sim.client_states``."""
        # the largest clients start first (longest-processing-time order), so that no worker is left training a big
        # client alone at the end of the round; the uploads are still taken in the order of ``jobs``
        sizes = [len(sim.data.clients[cid].y_train) for cid, _, _ in jobs]
        futures: list[Future[bytes]] = [None] * len(jobs)  # type: ignore[list-item]
        for i in sorted(range(len(jobs)), key=lambda i: -sizes[i]):
            cid, received, broadcast = jobs[i]
            futures[i] = self._pool.submit(_train_one, pack((cid, rnd, received, broadcast, sim.client_states[cid])))
        try:
            for (cid, _, _), future in zip(jobs, futures, strict=True):
                try:
                    update, state = unpack(future.result())
                except BrokenProcessPool as exc:
                    raise WorkerDied(
                        f"round {rnd}: a worker process died while training client {cid} or a client beside it "
                        "(killed, out of memory, or a crash in native code); no result of this round was kept"
                    ) from exc
                sim.client_states[cid] = state
                yield update
        finally:
            for future in futures:
                future.cancel()

    def score(self, sim: ClientHost, passes: Sequence[tuple[Params, EvalSource]], batch_size: int) -> list[BatchScores]:
        """:func:`~fedskew.engine.evaluate.batch_scores` of each ``(params, source)`` pass, computed in the workers:
        a pass over many samples is split into one range of whole batches per worker, so the batches, and therefore
        the scores, are exactly those of the pass in one process."""
        jobs: list[tuple[int, Future[bytes]]] = []
        for k, (params, source) in enumerate(passes):
            n = sim.eval_tensors(source)[1].shape[0]
            per = math.ceil(math.ceil(n / batch_size) / self.n) * batch_size  # samples per range: whole batches
            for start in range(0, n, max(per, 1)):
                job = pack((params, source, start, min(start + per, n), batch_size))
                jobs.append((k, self._pool.submit(_score_one, job)))
        out: list[BatchScores] = [[] for _ in passes]
        for k, future in jobs:
            try:
                out[k].extend(unpack(future.result()))
            except BrokenProcessPool as exc:
                raise WorkerDied("a worker process died while evaluating (killed or out of memory)") from exc
        return out

    def close(self) -> None:
        if os.getpid() != self._owner:
            return
        processes = list((getattr(self._pool, "_processes", None) or {}).values())
        if getattr(self._pool, "_broken", False):
            # a worker died: the others may be stuck (a forked child can inherit a lock some thread of the parent
            # held), so waiting for them could hang; stop them and do not wait
            for proc in processes:
                if proc.is_alive():
                    proc.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
            for proc in processes:
                proc.join(timeout=10)
            return
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ClientWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
