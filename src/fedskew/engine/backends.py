"""The ways the loop can train a round's clients besides one after the other, behind
:class:`~fedskew.engine.host.ClientTrainer`: the only module that knows both ``engine/workers.py`` and
``engine/batched.py``; the loop knows them through this one."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from fedskew.engine.batched import batchable, train_batched
from fedskew.engine.host import ClientHost, ClientPool, ClientTrainer, TrainJob
from fedskew.engine.workers import ClientWorkers
from fedskew.protocol import Upload


class BatchedClients:
    """All of a round's clients trained together, vmapped (``batched_clients``; equal up to float32 rounding)."""

    def train(self, host: ClientHost, rnd: int, jobs: Sequence[TrainJob]) -> list[Upload]:
        cids = [cid for cid, _, _ in jobs]
        received = {cid: params for cid, params, _ in jobs}
        broadcast = jobs[0][2] if jobs else {}
        return train_batched(host, rnd, cids, received, broadcast)

    def close(self) -> None:
        pass


def batched_trainer(host: ClientHost, stacklevel: int = 2) -> ClientTrainer | None:
    """The batched trainer for the host's method and model, or ``None`` (with a warning saying why) when
    :func:`~fedskew.engine.batched.batchable` refuses them: the clients are then trained one after the other."""
    why = batchable(host.method, host.model)
    data = getattr(host, "data", None)
    if why is None and data is not None and any(c.input_noise for c in data.clients):
        why = "the clients' feature noise is drawn at every access in the sequential loop (noise_draw: once batches)"
    if why is not None:
        warnings.warn(f"batched_clients: {why}; training the clients one after the other", stacklevel=stacklevel + 1)
        return None
    return BatchedClients()


def worker_pool(host: ClientHost, n: int) -> ClientPool:
    """``n`` forked processes that train (and score for) the host's clients (identical results)."""
    return ClientWorkers(host, n)
