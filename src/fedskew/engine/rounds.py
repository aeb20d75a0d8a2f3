"""The parts of a round that every runtime shares, the simulator (:class:`fedskew.engine.loop.Simulation`) and a
deployment (the Flower apps): who is sampled and who drops out (both seeded by (seed, round)), what travels (payload
bytes), one client's local step (:func:`train_client`, :func:`keep_trained`, :func:`with_local`), a round in progress
and its result (:class:`RoundPlan`, :class:`RoundResult`), and :class:`Diverged`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fedskew.client.local import LOCAL_PARAMS, LocalContext, PersonalContext, TrainSettings, local_train, overrides
from fedskew.privacy.mechanism import DP_CLIP, DP_UNCLIPPED, clip_update
from fedskew.protocol import ClientScores, Params, Upload
from fedskew.seeding import Purpose, numpy_rng, torch_generator
from fedskew.server.streaming import RunningSum
from fedskew.server.uploads import UploadStack

# LOCAL_PARAMS: a client's state-dict entries that never travel (method.local: FedPer's head, FedBN's norms), the
# engine's own entry in every client's state (fedskew.client.local)
__all__ = ["LOCAL_PARAMS"]

if TYPE_CHECKING:
    from fedskew.config import RunConfig
    from fedskew.methods import Method


def payload_bytes(tensors: Params) -> int:
    """Bytes on the wire: boolean tensors (masks) count 1 bit per element, others their dtype size."""
    total = 0
    for t in tensors.values():
        total += math.ceil(t.numel() / 8) if t.dtype == torch.bool else t.numel() * t.element_size()
    return total


def sample_clients(seed: int, rnd: int, num_clients: int, join_ratio: float, kind: str = "fixed") -> list[int]:
    """``fixed``: ``max(1, round(join_ratio * N))`` distinct clients; ``poisson``: each client independently with
    probability ``join_ratio`` (possibly none). Drawn from a stream keyed by (seed, round)."""
    if kind == "poisson":
        u = numpy_rng(seed, Purpose.SAMPLING, rnd).random(num_clients)
        return [int(c) for c in np.flatnonzero(u < join_ratio)]
    m = cohort_size(num_clients, join_ratio)
    if m >= num_clients:
        return list(range(num_clients))
    rng = numpy_rng(seed, Purpose.SAMPLING, rnd)
    return sorted(int(c) for c in rng.choice(num_clients, size=m, replace=False))


def cohort_size(num_clients: int, join_ratio: float) -> int:
    """The number of clients fixed-size sampling draws each round."""
    return max(1, int(round(join_ratio * num_clients)))


def dropped_out(seed: int, rnd: int, sampled: list[int], num_clients: int, p: float) -> list[int]:
    """The sampled clients that fail to report in round ``rnd``, each with probability ``p``.

    One uniform number per client of the federation is drawn from a stream keyed by (seed, round) of its own
    (:attr:`Purpose.DROPOUT`); client ``c`` drops out when ``u[c] < p``. So sampling is the same with or without
    dropout, whether a client drops out depends on nothing but (seed, round, client, p), and a larger ``p`` only
    removes more clients."""
    if p <= 0:
        return []
    u = numpy_rng(seed, Purpose.DROPOUT, rnd).random(num_clients)
    return [c for c in sampled if u[c] < p]


class Diverged(RuntimeError):
    """Training diverged: a non-finite or exploding training loss, or a non-finite model. The run stops there."""

    def __init__(self, rnd: int, reason: str) -> None:
        super().__init__(f"training diverged in round {rnd}: {reason}")
        self.round = rnd
        self.reason = reason


@dataclass
class RoundResult:
    record: dict[str, Any]  # one line of metrics.jsonl
    client_scores: dict[str, ClientScores] = field(default_factory=dict)  # view -> per-client scores
    probe: dict[str, Any] | None = None  # parameter-skew probe (evaluated rounds), see engine/probe.py


@dataclass
class RoundPlan:
    """One round in progress on the server: who was sampled and who dropped out (both seeded), what the server
    broadcasts, and what the uploads taken so far came to. :meth:`RoundServer.open_round` makes it,
    :meth:`RoundServer.take_upload` fills it (one upload at a time, in client order), :meth:`RoundServer.close_round`
    aggregates, evaluates and records it. The simulator trains the clients in between; a deployment (Flower) sends
    them messages, and fills ``failed`` with the sampled clients that never replied."""

    rnd: int
    sampled: list[int]
    gone: set[int]  # sampled, but drop out before reporting (client_dropout, seeded)
    broadcast: Params
    stack: UploadStack | RunningSum  # RunningSum: streaming aggregation (server/streaming.py)
    t0: float
    losses: list[tuple[int, int, float]] = field(default_factory=list)  # (cid, samples, loss) of counted uploads
    bytes_up: int = 0
    bytes_down: int = 0
    failed: list[dict[str, Any]] = field(default_factory=list)  # [{"client": cid, "reason": ...}] (deployments)


def train_settings(cfg: RunConfig) -> TrainSettings:
    """The local optimizer's settings of a run and its number of rounds (every client's, wherever it trains)."""
    return TrainSettings(
        epochs=cfg.local_epochs,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        drop_last=cfg.drop_last,
        rounds=cfg.rounds,
        precision=cfg.precision,
    )


def train_client(
    method: Method,
    model: nn.Module,
    settings: TrainSettings,
    seed: int,
    cid: int,
    rnd: int,
    received: Params,
    broadcast: Params,
    client_state: dict[str, Any],
    x: torch.Tensor,
    y: torch.Tensor,
    x_val: torch.Tensor | None = None,
    y_val: torch.Tensor | None = None,
    clip: UpdateClip | None = None,
    input_noise: float = 0.0,
    live: bool = False,
) -> Upload:
    """Client ``cid``'s local training in round ``rnd``, wherever the client runs (the simulator, a Flower
    ClientApp): the method's local algorithm on the one loop, batches drawn from the (seed, client, round) stream.
    ``client_state`` is the client's persistent state and advances in place. ``x_val``/``y_val``: its validation
    split, if the run has one (hooks may score it; it is never trained on). ``clip``: under user-level DP, the
    update it uploads, with its extras, is clipped (:func:`fedskew.privacy.mechanism.clip_update`). ``input_noise``:
    the std of the noise added to every training batch (NIID-Bench's feature noise drawn at every access). ``live``:
    the upload's params are the model's own tensors (:func:`~fedskew.client.local.local_train`)."""
    ctx = LocalContext(
        cid=cid,
        round=rnd,
        model=model,
        received=received,
        client_state=client_state,
        broadcast=broadcast,
        settings=settings,
        x_val=x_val,
        y_val=y_val,
    )
    gen = torch_generator(seed, Purpose.SHUFFLE, cid, rnd)
    upload = local_train(method.client, ctx, x, y, gen, method.upload_extras, input_noise, live)
    if clip is None:
        return upload
    norm = float(broadcast[DP_CLIP]) if DP_CLIP in broadcast else clip.norm  # adaptive clipping: the round's
    # the extras (SCAFFOLD's control delta) are clipped with the model; the server sees only their noised sum
    scaled = {k: e * clip.extras_scale for k, e in upload.extras.items()} if clip.extras_scale != 1 else upload.extras
    params, before, extras = clip_update(received, upload.params, clip.names, norm, scaled)
    metrics = upload.metrics
    if DP_CLIP in broadcast:  # the bit the server's noised count of unclipped updates reads
        metrics = {**metrics, DP_UNCLIPPED: float(before <= norm)}
    return dataclasses.replace(upload, params=params, extras=extras, metrics=metrics)


@dataclass(frozen=True)
class UpdateClip:
    """User-level DP on the client: the update over ``names`` (every floating entry that travels) clipped to
    ``norm`` (under adaptive clipping, to the norm the server broadcasts this round)."""

    norm: float
    names: tuple[str, ...]
    extras_scale: float = 1.0  # the extras enter the clipped vector (and travel) multiplied by this


def keep_trained(
    method: Method,
    local_names: frozenset[str],
    client_state: dict[str, Any],
    upload: Upload,
    personalize: Callable[[Params], Params] | None = None,
    retain: Callable[[Params], Params] = lambda p: p,
) -> Params | None:
    """What a client keeps of the model it trained: its local entries (``method.local``) go into
    ``client_state[LOCAL_PARAMS]``; for a personalized method the model the ``trained`` view evaluates is returned
    (the model it keeps for itself, else the one it trained, through ``personalize`` when given: the client part's
    :func:`personalized`), otherwise ``None``. ``retain``: how what it keeps of the upload is held (a copy, when the
    upload's params are the model's own tensors: ``train_client(..., live=True)``)."""
    if local_names:
        client_state[LOCAL_PARAMS] = retain({k: upload.params[k] for k in local_names})
    if method.personalized:
        own = method.client.personal_model(client_state)
        if own is not None:
            return own
        return retain(upload.params if personalize is None else personalize(upload.params))
    return None


def personalized(
    method: Method,
    model: nn.Module,
    settings: TrainSettings,
    seed: int,
    cid: int,
    rnd: int,
    base: Params,
    client_state: dict[str, Any],
    x: torch.Tensor,
    y: torch.Tensor,
) -> Params:
    """Client ``cid``'s personalized model when it holds ``base`` in round ``rnd``, wherever it runs: its client
    part's :meth:`~fedskew.client.local.LocalAlgorithm.personalize` of ``base`` (draws from the (seed, client, round)
    stream of :attr:`Purpose.PERSONALIZE`), or ``base`` for a part without one."""
    algo = method.client
    if not overrides(algo, "personalize"):
        return base
    gen = torch_generator(seed, Purpose.PERSONALIZE, cid, rnd)
    ctx = PersonalContext(cid, rnd, model, base, client_state, settings, x, y, gen)
    out = algo.personalize(ctx)
    return base if out is None else out


def with_local(received: Params, local: Params | None, order: Params) -> Params:
    """The model a client holds after receiving ``received``: the entries it keeps for itself (``local``)
    overlaid, keys in the order of ``order`` (the model's state dict)."""
    if not local:
        return received
    return {k: local[k] if k in local else received[k] for k in order}
