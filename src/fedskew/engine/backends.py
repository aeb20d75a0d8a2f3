"""The ways the loop can train a round's clients besides one after the other, behind
:class:`~fedskew.engine.host.ClientTrainer`: the only module that knows both ``engine/workers.py`` and
``engine/batched.py``; the loop knows them through this one."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import nn

from fedskew.client.local import batched_form
from fedskew.engine.batched import batchable, train_batched
from fedskew.engine.captured import PaddedCache, capture_refusal
from fedskew.engine.host import ClientHost, ClientPool, ClientTrainer, TrainJob
from fedskew.engine.stacked import layer_forms
from fedskew.engine.workers import ClientWorkers
from fedskew.protocol import Upload
from fedskew.schema import ConfigError


class BatchedClients:
    """All of a round's clients trained together, vmapped (``batched_clients``; equal up to float32 rounding);
    ``capture``: at a few padded shapes, replayed as CUDA graphs on a CUDA device (``capture_steps``); ``conv``: the
    stacked convolutions' form (``stacked_conv``)."""

    def __init__(self, capture: bool = False, conv: str = "grouped") -> None:
        self.conv = conv
        self.capture = PaddedCache() if capture else False  # the run's graphs, replayed round after round

    def train(self, host: ClientHost, rnd: int, jobs: Sequence[TrainJob]) -> list[Upload]:
        cids = [cid for cid, _, _ in jobs]
        received = {cid: params for cid, params, _ in jobs}
        broadcast = jobs[0][2] if jobs else {}
        sent = {cid: own for cid, _, own in jobs}  # the broadcast, and a client's downloads (FedFomo's peers)
        return train_batched(host, rnd, cids, received, broadcast, capture=self.capture, sent=sent, conv=self.conv)

    def close(self) -> None:
        pass


def batched_trainer(host: ClientHost, stacklevel: int = 2) -> ClientTrainer | None:
    """The batched trainer for the host's method and model, or ``None`` (with a warning saying why) when
    :func:`~fedskew.engine.batched.batchable` refuses them: the clients are then trained one after the other."""
    why = batchable(host.method, host.model, host.settings.precision)
    data = getattr(host, "data", None)
    if why is None and data is not None and any(c.input_noise for c in data.clients):
        why = "the clients' feature noise is drawn at every access in the sequential loop (noise_draw: once batches)"
    if why is not None:
        warnings.warn(f"batched_clients: {why}; training the clients one after the other", stacklevel=stacklevel + 1)
        return None
    cfg = getattr(host, "cfg", None)
    capture = bool(getattr(cfg, "capture_steps", False))
    if capture:
        form = batched_form(host.method.client)
        refusal = capture_refusal(form, host.model) if not isinstance(form, str) else form
        if refusal is not None:
            warnings.warn(f"capture_steps: {refusal}; batched steps in buckets", stacklevel=stacklevel + 1)
            capture = False
    return BatchedClients(capture, conv_form(cfg, host.model))


def warn_unbatched(cfg: object, stacklevel: int = 2) -> None:
    """Warn when a run that trains its clients one after the other sets what only batched steps read."""
    form = str(getattr(cfg, "stacked_conv", "grouped"))
    if form != "grouped":
        warnings.warn(
            f"stacked_conv {form} shapes the convolutions of batched steps (batched_clients, or sweep --stack-seeds); "
            "this run trains its clients one after the other, so it has no effect",
            stacklevel=stacklevel + 1,
        )


def conv_form(cfg: object, model: nn.Module | None = None) -> str:
    """The stacked convolutions' form of a run (``engine/stacked.py``'s :data:`CONV_FORMS`): its ``stacked_conv``, the
    grouped one in channels-last memory order when the run asks for ``channels_last`` (as its model's are). With the
    run's ``model``, a list of forms (one per Conv2d layer) is checked against its layers before training starts
    (:class:`~fedskew.schema.ConfigError` naming the counts)."""
    forms = str(getattr(cfg, "stacked_conv", "grouped")).split(",")  # one form, or one per Conv2d layer
    if getattr(cfg, "channels_last", False):
        forms = ["grouped_channels_last" if form == "grouped" else form for form in forms]
    form = ",".join(forms)
    if model is not None:
        try:
            layer_forms(model, form)
        except ValueError as e:
            raise ConfigError(f"stacked_conv: {e}") from None
    return form


def worker_pool(host: ClientHost, n: int) -> ClientPool:
    """``n`` forked processes that train (and score for) the host's clients (identical results)."""
    return ClientWorkers(host, n)
