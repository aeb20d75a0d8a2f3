"""FedHEAL server step: FPHL consistency masks + FAEL momentum weights (Chen et al., CVPR 2024; spec 4).

**FPHL** (paper Eq. 5-9, :class:`HealMasks`): for each client the server keeps, per element of every floating
state-dict tensor, how many of that client's past updates ``Δ = w_k - W`` were non-negative. An element of
this round's update is kept when its direction agrees with the client's history often enough: consistency
``c = L`` if ``Δ >= 0`` else ``1 - L`` (``L`` = fraction of non-negative past updates, before this round's
update), mask ``c > tau``.

**FAEL** (paper Eq. 11-12, :class:`FaelWeights`): ``d_k`` = size of the masked update,
``dp_k <- (1 - beta)·dp_k + beta·d_k / Σ_j d_j``, ``p_k <- p_k + dp_k`` (carried unnormalized), weight
``p_k / Σ_{participants} p_j``. The elementwise renormalization over the clients that keep an element (Eq. 9)
and the "nobody keeps it: unchanged" rule are :class:`~fedskew.server.combine.WeightedMean` with masks.

Paper-vs-code switches (default: official code; spec 4.4 N1-N8 and section 7):

- ``strict``: ``True`` (code) keeps ``c > tau``; ``False`` (paper Eq. 9) keeps ``c >= tau``.
- ``distance``: ``'l2_per_tensor'`` (code) Σ over tensors of ‖Δ̃‖₂; ``'squared'`` (paper Eq. 11) ‖Δ̃‖₂².
- ``fael_init``: ``'uniform'`` (code) ``p⁰`` uniform; ``'datasize'`` (paper: beta = 0 equals FedAvg)
  ``p⁰ = N_k / Σ N``.
- ``uniform_over`` (only with ``fael_init='uniform'``): ``'participants'`` (code, spec 4.2/N4/N8) ``p⁰ = 1/|K^t|``,
  the size of the round in which the client first participates; ``'clients'`` ``p⁰ = 1/N`` (every client alike,
  wherever it joins). The two are equal under full participation.

Zero updates count as non-negative (paper convention, N1). Both pieces key their state on the client id and
only advance a client's entry when it participates (N5, N8): a client's first participation is unmasked, the
distance share is normalized over the round's participants, and FAEL weights are normalized over the
participants. Integer buffers (``num_batches_tracked``) are not tracked and always unmasked; the combine takes
their max (the official code masks them too, but their update is always positive, so their mask is 1 anyway,
N7). ``tau < 0`` disables FPHL (every mask True, no tables kept); with ``beta = 0`` FAEL keeps ``p⁰``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, ValidationError
from torch import Tensor

from fedskew.protocol import Params, RoundInput, ServerContext
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import ConfigError, StrictSettings, describe_errors
from fedskew.server.api import Aggregation, Masking, Weighting
from fedskew.server.combine import WeightedMean, column_blocks
from fedskew.server.paging import release_pages
from fedskew.server.weights import normalize
from fedskew.space import Float

DISTANCES = ("l2_per_tensor", "squared")
FAEL_INITS = ("uniform", "datasize")
UNIFORM_OVER = ("participants", "clients")
_TAU_MAX_DENOMINATOR = 10**6


def _finite_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(float(x))


def _float_names(rin: RoundInput) -> list[str]:
    return [name for name, stacked in rin.params.items() if stacked.is_floating_point()]


# ----------------------------------------------------------------------------------------------------- FPHL


@dataclass(frozen=True)
class SignHistory:
    """One client's FPHL table: per element, how many of its ``rounds`` updates were non-negative, in the narrowest
    integer dtype that holds ``rounds`` (:func:`count_dtype`: one byte per element for 255 participations)."""

    nonneg: dict[str, Tensor]
    rounds: int

    def proportion(self, name: str) -> Tensor:
        """The paper's ``l_m`` (Eq. 5) for one tensor, as float64."""
        return self.nonneg[name].to(torch.float64) / self.rounds


HealMaskState = dict[int, SignHistory]


def count_dtype(rounds: int) -> torch.dtype:
    """The narrowest integer dtype for counts up to ``rounds``: the FPHL tables (one count per element of every
    participant's model) stay a quarter of the model's float32 size for the first 255 participations."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if rounds <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def consistent(up: Tensor, past: Tensor, n: int, need: int) -> Tensor:
    """FPHL's mask from exact integer counts: ``agree >= need``, where ``agree`` is the number of the ``n`` past
    updates with this update's sign (``past`` non-negative ones where ``up``, else ``n - past``). Compared in the
    table's own dtype (``0 <= past <= n``), so ``need`` outside ``[0, n]`` is decided here, not cast."""
    if need > n:  # no count reaches it (and n - need < 0 would wrap around in an unsigned table)
        return torch.zeros_like(up)
    return torch.where(up, past >= need, past <= n - need)


class HealParams(StrictSettings):
    """FedHEAL's hyper-parameters: the one place of their defaults and bounds, read by the ``heal`` plug-in's
    arguments, :class:`HealMasks`, :class:`FaelWeights`, :func:`heal_aggregation` and the Flower strategy
    (``fedskew.flower.strategies.FedHEAL``). ``tau = 0.3`` and ``beta = 0.4`` are the paper's Digits values."""

    tau: float = 0.3
    beta: float = Field(0.4, ge=0, le=1)
    strict: bool = True
    distance: Literal["l2_per_tensor", "squared"] = "l2_per_tensor"
    fael_init: Literal["uniform", "datasize"] = "uniform"
    uniform_over: Literal["participants", "clients"] = "participants"


HEAL = HealParams()  # the defaults


@dataclass(frozen=True)
class HealMasks(Masking):
    """FPHL (paper Eq. 5-9): keep an element of client k's update when its sign agrees with k's history.

    ``tau`` (default 0.3, Digits; 0.4 Office-Caltech) is read as the nearest fraction with denominator <= 10^6
    and compared with the integer counts exactly, so ``c = 3/10`` versus ``tau = 0.3`` is a tie (kept only
    when ``strict=False``). State: ``dict[cid, SignHistory]``; a new dict is returned each round and the
    previous state's tensors are never modified.
    """

    tau: float = HEAL.tau
    strict: bool = HEAL.strict

    def __post_init__(self) -> None:
        if not _finite_real(self.tau):
            raise ValueError(f"FedHEAL tau must be a finite number, got {self.tau!r}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"FedHEAL strict must be a bool, got {self.strict!r}")

    @property
    def enabled(self) -> bool:
        return self.tau >= 0

    def _tau_fraction(self) -> tuple[int, int]:
        frac = Fraction(repr(float(self.tau))).limit_denominator(_TAU_MAX_DENOMINATOR)
        # c <= 1, so every tau > 1 behaves alike; capping keeps the integer products small
        frac = min(frac, Fraction(2))
        return frac.numerator, frac.denominator

    def init(self, ctx: ServerContext | None) -> HealMaskState:
        return {}

    def __call__(self, rin: RoundInput, state: HealMaskState) -> tuple[Params, HealMaskState]:
        k = rin.num_participants
        masks: Params = {}
        for name, stacked in rin.params.items():  # where the uploads are (a disk-backed stack: beside them)
            masks[name] = rin.empty(f"mask:{name}", (k, *stacked.shape[1:]), torch.bool, stacked.device).fill_(True)
            release_pages()
        if not self.enabled:
            return masks, state
        num, den = self._tau_fraction()
        names = _float_names(rin)
        new_state = dict(state)
        for i, cid in enumerate(rin.cids):
            release_pages()  # a disk-backed stack: the previous client's rows go back to the kernel
            # w >= W is exactly the sign test of w - W (no rounding in a comparison)
            nonneg_now = {name: rin.params[name][i] >= rin.global_params[name] for name in names}
            history = state.get(cid)
            if history is None:  # first participation: unmasked, the table starts from this update
                counts = {name: up.to(count_dtype(1)) for name, up in nonneg_now.items()}
                new_state[cid] = SignHistory(counts, 1)
                continue
            if sorted(history.nonneg) != sorted(names):
                raise ValueError(
                    f"client {cid}: FedHEAL history covers tensors {sorted(history.nonneg)}, upload has {sorted(names)}"
                )
            n = history.rounds
            # c > tau  <=>  agree·den > num·n  <=>  agree >= num·n // den + 1  (>= tau: agree >= ceil(num·n / den))
            need = num * n // den + 1 if self.strict else -(-num * n // den)
            counts = {}
            for name, up in nonneg_now.items():
                past = history.nonneg[name]
                if past.shape != up.shape:
                    raise ValueError(f"client {cid}: tensor '{name}' changed shape since its last participation")
                masks[name][i] = consistent(up, past, n, max(need, 0))
                if n + 1 > torch.iinfo(past.dtype).max:
                    past = past.to(count_dtype(n + 1))
                counts[name] = past + up  # the table's dtype (bool promotes to it)
            new_state[cid] = SignHistory(counts, n + 1)
        return masks, new_state


# ----------------------------------------------------------------------------------------------------- FAEL


def masked_delta_sq_norms(x: Tensor, start: Tensor, mask: Tensor | None = None) -> Tensor:
    """``[K]`` float64 squared Euclidean norms of the rows of ``(x - start) ⊙ mask`` (``x``: ``[K, M]``), computed
    block by block of columns (no ``K × M`` float64 copy)."""
    k, m = x.shape
    sq = torch.zeros(k, dtype=torch.float64, device=x.device)
    buf = None
    for cols in column_blocks(k, m, x.device):
        if buf is None:
            buf = torch.empty((k, cols.stop - cols.start), dtype=torch.float64, device=x.device)
        delta = buf[:, : cols.stop - cols.start]
        delta.copy_(x[:, cols]).sub_(start[cols].to(torch.float64))
        if mask is not None:
            delta.masked_fill_(~mask[:, cols], 0.0)
        sq += delta.square_().sum(1)
    return sq


def fael_distances(rin: RoundInput, masks: Params | None, distance: str = "l2_per_tensor") -> np.ndarray:
    """``[K]`` float64 size of each client's masked update over the trainable float tensors (paper Eq. 11).

    ``'l2_per_tensor'`` (code): Σ over tensors of the Euclidean norm; ``'squared'`` (paper): squared norm of
    the whole masked update. Buffers are excluded in both forms (spec section 7).
    """
    if distance not in DISTANCES:
        raise ValueError(f"unknown FAEL distance {distance!r}; expected one of {DISTANCES}")
    k = rin.num_participants
    d = torch.zeros(k, dtype=torch.float64)
    for name, stacked in rin.params.items():
        if name not in rin.trainable or not stacked.is_floating_point():
            continue
        mask = None if masks is None or name not in masks else masks[name].reshape(k, -1)
        sq = masked_delta_sq_norms(stacked.reshape(k, -1), rin.global_params[name].reshape(-1), mask)
        d += (sq.sqrt() if distance == "l2_per_tensor" else sq).cpu()
    return d.numpy()


@dataclass(frozen=True)
class FaelMomentum:
    """One client's FAEL state: cumulative unnormalized weight ``p`` and momentum ``dp`` (paper Eq. 12)."""

    p: float
    dp: float


@dataclass(frozen=True)
class FaelState:
    clients: dict[int, FaelMomentum]  # only clients that have participated
    p0: tuple[float, ...]  # [N] initial p of every client (unused for fael_init='uniform', uniform_over='participants')


@dataclass(frozen=True)
class FaelWeights(Weighting):
    """FAEL (paper Eq. 11-12): momentum-smoothed share of the masked-update distance, accumulated per client.

    Per round, for the participants only: ``share = d / Σ d`` (all zero: ``1/K``), ``dp <- (1 - beta)·dp +
    beta·share``, ``p <- p + dp`` (stored unnormalized, N6), weights ``p / Σ_participants p``. A client's
    first participation starts from ``dp = 0`` and ``p = p⁰``: ``fael_init='uniform'`` (code) ``1/|K^t|``, the
    number of participants of that round (spec 4.2, N4, N8; ``uniform_over='clients'``: ``1/N``), or
    ``'datasize'`` (paper, makes beta = 0 equal FedAvg) ``num_train[cid] / Σ num_train``. (The field is called
    ``fael_init`` because ``init`` is the protocol method.)
    """

    beta: float = HEAL.beta
    distance: str = HEAL.distance
    fael_init: str = HEAL.fael_init
    uniform_over: str = HEAL.uniform_over

    def __post_init__(self) -> None:
        if not _finite_real(self.beta) or not 0 <= self.beta <= 1:
            raise ValueError(f"FedHEAL beta must be in [0, 1], got {self.beta!r}")
        if self.distance not in DISTANCES:
            raise ValueError(f"unknown FAEL distance {self.distance!r}; expected one of {DISTANCES}")
        if self.fael_init not in FAEL_INITS:
            raise ValueError(f"unknown FAEL init {self.fael_init!r}; expected one of {FAEL_INITS}")
        if self.uniform_over not in UNIFORM_OVER:
            raise ValueError(f"unknown FAEL uniform_over {self.uniform_over!r}; expected one of {UNIFORM_OVER}")

    def init(self, ctx: ServerContext | None) -> FaelState:
        if ctx is None:
            raise ValueError("FaelWeights needs a ServerContext (number of clients, training-set sizes)")
        n = int(ctx.num_clients)
        if n <= 0:
            raise ValueError(f"num_clients must be positive, got {n}")
        if self.fael_init == "uniform":
            return FaelState({}, tuple([1.0 / n] * n))
        sizes = np.asarray(ctx.num_train, dtype=np.float64)
        if sizes.shape != (n,) or not np.all(np.isfinite(sizes)) or np.any(sizes <= 0):
            raise ValueError(f"fael_init='datasize' needs num_train of {n} positive sizes, got {sizes.tolist()}")
        return FaelState({}, tuple((sizes / sizes.sum()).tolist()))

    def __call__(self, rin: RoundInput, masks: Params | None, state: FaelState) -> tuple[Tensor, FaelState]:
        d = fael_distances(rin, masks, self.distance)
        total = d.sum()
        share = d / total if total > 0 else np.full(len(d), 1.0 / len(d))
        clients = dict(state.clients)
        per_round = self.fael_init == "uniform" and self.uniform_over == "participants"
        p_now = []
        for i, cid in enumerate(rin.cids):
            if not 0 <= cid < len(state.p0):
                raise ValueError(f"client id {cid} outside [0, {len(state.p0)})")
            p0 = 1.0 / len(d) if per_round else state.p0[cid]
            prev = clients.get(cid, FaelMomentum(p0, 0.0))
            dp = (1.0 - self.beta) * prev.dp + self.beta * float(share[i])
            clients[cid] = FaelMomentum(prev.p + dp, dp)
            p_now.append(prev.p + dp)
        weights = normalize(torch.tensor(p_now, dtype=torch.float64))
        return weights, FaelState(clients, state.p0)


# ---- registration ----------------------------------------------------------------------------------------------------
def heal_pieces(p: HealParams) -> dict[str, Any]:
    """FedHEAL's two pieces from its validated hyper-parameters: the FPHL masks and the FAEL weights (the one
    builder: the ``heal`` plug-in and :func:`heal_aggregation` both use it)."""
    return {
        "masking": HealMasks(tau=p.tau, strict=p.strict),
        "weighting": FaelWeights(beta=p.beta, distance=p.distance, fael_init=p.fael_init, uniform_over=p.uniform_over),
    }


def heal_aggregation(
    tau: float = HEAL.tau,
    beta: float = HEAL.beta,
    *,
    strict: bool = HEAL.strict,
    distance: str = HEAL.distance,
    fael_init: str = HEAL.fael_init,
    uniform_over: str = HEAL.uniform_over,
) -> Aggregation:
    """FedHEAL's server step (FPHL masks -> FAEL weights -> masked weighted mean), for any client method; the
    arguments are checked by :class:`HealParams`, as the plug-in's ``-m`` arguments are."""
    try:
        p = HealParams(
            tau=tau, beta=beta, strict=strict, distance=distance, fael_init=fael_init, uniform_over=uniform_over
        )
    except ValidationError as exc:
        raise ConfigError(f"FedHEAL: {'; '.join(describe_errors(exc))}") from None
    pieces = heal_pieces(p)
    return Aggregation(weighting=pieces["weighting"], combine=WeightedMean(), masking=pieces["masking"])


CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "heal": ServerPlugin(
        "heal",
        "FPHL update-consistency masks (tau=0.3) + FAEL momentum distance weights (beta=0.4)",
        "Chen et al., Fair Federated Learning under Domain Skew with Local Consistency and Domain Diversity, CVPR 2024",
        HealParams,
        ("masking", "weighting"),
        heal_pieces,
        tunable={"tau": Float(0.1, 0.6), "beta": Float(0.1, 0.9)},  # FedHEAL Table 4 / Fig. 6
    ),
}
