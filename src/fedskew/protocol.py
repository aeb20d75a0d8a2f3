"""What the client side and the server side of a federated round exchange, and nothing else.

Both sides, the engine, the results store and any deployment (a Flower app) import these types from here; this module
imports neither side, so ``fedskew.client`` never imports ``fedskew.server`` nor the reverse
(``tests/test_boundaries.py`` keeps it so).

* :class:`Upload`: what one client uploads after local training (model, sample count, extra tensors, metrics);
* :class:`ClientReport`: a statistic each client computes from its own training labels and sends once, before the
  first round, because a method part declared that it needs it (:data:`LABEL_HIST`; FedDisco's discrepancy), and
  :func:`client_reports`, which computes the declared ones; nothing else about a client's data leaves it;
* :class:`ServerContext`: what the server knows before the first round;
* :class:`RoundInput`: one round's valid uploads stacked along a leading client axis, as every server piece reads them;
* :class:`Rejection`, :class:`UploadError`: an upload the server refuses, and why;
* the generic names both sides spell the same way: the metrics every upload reports (:data:`TRAIN_LOSS`,
  :data:`STEPS`) and the timing fields of a round's record (:data:`TIMING_KEYS`). The tensors a method's client part
  uploads and its server half broadcasts are named in the method's own module (SCAFFOLD's ``SCAFFOLD_C`` in
  :mod:`fedskew.catalog.scaffold`, FedCAC's ``MASK_PREFIX`` in :mod:`fedskew.catalog.fedcac`, ...), and a wrapper's
  metrics in the wrapper's (``LOSS_BEFORE`` in :mod:`fedskew.client.loss_before`): this module knows no method;
* :class:`ClientScores`: one evaluation view's per-client sums, as the engine computes them and the results store
  records them (so ``fedskew.results`` never imports the engine).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import Tensor

TIMING_KEYS = ("time_train", "time_aggregate", "time_eval", "time_probe", "time_round")  # per-round wall times

# ---- metrics an upload reports (Upload.metrics; RoundInput.metrics on the server, [K] float64 each) ----------------
TRAIN_LOSS = "train_loss"  # every client: the sample-weighted mean loss of its local steps
STEPS = "steps"  # every client: its local optimizer steps (FedNova's tau_k, q-FFL's step count)

# ---- tensors a client part and its server side exchange (upload extras; broadcast with the model) -----------------
# a trailing "/" marks a prefix: one tensor per trainable state-dict entry n, named PREFIX + n

Params = dict[str, Tensor]
State = Any


@dataclass(frozen=True)
class ClientScores:
    """One evaluation view's per-client sums: correct predictions, summed loss and samples scored, each ``[N]``."""

    correct: np.ndarray  # [N]
    loss_sum: np.ndarray  # [N]
    count: np.ndarray  # [N]

    @property
    def accuracy(self) -> np.ndarray:
        return np.divide(self.correct, self.count, out=np.zeros(len(self.count)), where=self.count > 0)


class UploadError(ValueError):
    """A client upload that the server refuses (NaN/Inf, wrong shape or dtype, unknown tensor)."""


class NonFiniteUploadError(UploadError):
    """An upload holding NaN or Inf. In a simulation, where fedskew trained the client itself, this is divergence."""


@dataclass(frozen=True)
class Rejection:
    """Why the server refused one client's upload (see :func:`check_upload`)."""

    cid: int
    reason: str
    nonfinite: bool = False  # NaN/Inf in a well-formed upload (in a simulation: that client diverged)

    def error(self) -> UploadError:
        """The exception the ``fail`` policy raises for it."""
        cls = NonFiniteUploadError if self.nonfinite else UploadError
        return cls(f"client {self.cid}: {self.reason}")

    def as_record(self) -> dict[str, Any]:
        """JSON form for the round's record: ``{"client": 3, "reason": "..."}``."""
        return {"client": self.cid, "reason": self.reason}


@dataclass(frozen=True)
class Upload:
    """What one client uploads after local training."""

    cid: int
    params: Params
    num_samples: int | float  # a count (a Flower strategy also takes a non-integer weight, as Flower's FedAvg)
    extras: Params = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientReport:
    """A statistic every client computes from its own training labels and sends to the server once, before round 1.

    A method part that needs one declares it (a ``reports`` attribute: a tuple of these, on a server piece or a local
    algorithm); the engine gathers the declared ones (``Method.reports``) and nothing else about a client's data
    reaches the server: its sample count, and these. In a simulation the engine computes them from the partition; on
    Flower each client computes them itself (:func:`client_reports`) and only the values travel. ``compute`` maps the
    client's training label histogram ``[C]`` (int64) to a 1-D float64 vector (``[1]`` for a scalar); ``learns``
    says, for the docs and ``fedskew methods``, what the server learns from it."""

    name: str
    compute: Callable[[np.ndarray], np.ndarray]
    learns: str


def _histogram(hist: np.ndarray) -> np.ndarray:
    return np.asarray(hist, dtype=np.float64).reshape(-1)


LABEL_HIST = ClientReport("label_hist", _histogram, "the client's training label histogram (counts per class)")


def client_reports(reports: Iterable[ClientReport], train_hists: np.ndarray) -> dict[str, np.ndarray]:
    """``{name: [N, d] float64}``: each declared report computed for every client from its training label histogram
    (one row per client of ``train_hists``, ``[N, C]``), client by client as each client computes its own."""
    hists = np.asarray(train_hists)
    out: dict[str, np.ndarray] = {}
    for r in reports:
        rows = [np.asarray(r.compute(h), dtype=np.float64).reshape(-1) for h in hists]
        out[r.name] = np.stack(rows) if rows else np.zeros((0, 0))
    return out


def unique_reports(reports: Iterable[ClientReport]) -> tuple[ClientReport, ...]:
    """The reports once each, by name (two parts declaring the same name must mean the same statistic)."""
    seen: dict[str, ClientReport] = {}
    for r in reports:
        if r.name in seen and seen[r.name].compute != r.compute:
            raise ValueError(f"two method parts declare different client reports named {r.name!r}")
        seen.setdefault(r.name, r)
    return tuple(seen.values())


@dataclass(frozen=True)
class ServerContext:
    """What the server knows before the first round: the model's template, every client's training sample count, and
    the client reports the method's parts declared (:class:`ClientReport`); nothing else about the clients' data."""

    num_clients: int
    num_classes: int
    template: Params  # the initial global state dict (names, shapes, dtypes)
    trainable: frozenset[str]  # names of trainable parameters; the other state-dict entries are buffers
    num_train: np.ndarray  # [N] training samples per client
    # [N, num_classes] training label histogram per client: only when a part declared LABEL_HIST (else None)
    label_hists: np.ndarray | None = None
    seed: int = 0  # the run seed: server-side pieces that draw random numbers key their streams with it (seeding.py)
    reports: Mapping[str, np.ndarray] = field(default_factory=dict)  # declared client reports, name -> [N, d]


@dataclass(frozen=True)
class RoundInput:
    """One round's uploads, stacked along a leading client axis."""

    round: int
    cids: tuple[int, ...]
    params: Params  # name -> [K, *shape]
    num_samples: Tensor  # [K] float64
    extras: Params  # name -> [K, ...]
    global_params: Params  # the model broadcast at the start of the round
    trainable: frozenset[str]
    # [K, num_classes] participants' training label histograms: only when a part declared LABEL_HIST (else None)
    label_hists: np.ndarray | None = None
    rejected: tuple[Rejection, ...] = ()  # uploads left out under on_bad_update='drop'
    # scalar metrics every participant reported, [K] float64 each: "train_loss", "steps" (local optimizer steps:
    # FedNova's tau_k), and whatever a local algorithm adds (e.g. the loss before training)
    metrics: Mapping[str, Tensor] = field(default_factory=dict)
    reports: Mapping[str, np.ndarray] = field(default_factory=dict)  # participants' client reports, name -> [K, d]
    # the upload stack's allocator ``(key, shape, dtype, device) -> tensor``: None is torch.empty (see :meth:`empty`)
    alloc: Callable[[str, tuple[int, ...], Any, Any], Tensor] | None = field(default=None, compare=False, repr=False)

    @property
    def num_participants(self) -> int:
        return len(self.cids)

    def empty(self, key: str, shape: tuple[int, ...], dtype: Any, device: Any) -> Tensor:
        """An uninitialized tensor for a piece's own per-client result (``[K, ...]``, e.g. one mask per upload),
        where the round's uploads are: in RAM, or in a file beside a disk-backed stack (``aggregation disk``,
        :mod:`fedskew.server.paging`: write it row by row, or release the pages after a whole fill). ``key`` names
        it among the round's buffers (e.g. ``"mask:<tensor>"``)."""
        if self.alloc is None:
            import torch

            return torch.empty(shape, dtype=dtype, device=device)
        return self.alloc(key, shape, dtype, device)

    def delta(self, name: str) -> Tensor:
        """One tensor's per-client deltas ``w_k - w_global`` (``[K, *shape]``, the upload's dtype): a *delta* is
        what a client's training moved; an *upload* is what it sent (:class:`Upload`)."""
        return self.params[name] - self.global_params[name].unsqueeze(0)

    def deltas(self) -> Mapping[str, Tensor]:
        """Per-client deltas ``w_k - w_global`` of the float tensors, computed tensor by tensor when read (never all
        at once, nothing cached): iterate, or index the tensor you need."""
        return _Deltas(self)


class _Deltas(Mapping[str, Tensor]):
    def __init__(self, rin: RoundInput) -> None:
        self._rin = rin
        self._names = [n for n, t in rin.params.items() if t.is_floating_point()]

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._rin.delta(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
