"""FedDisco: discrepancy-aware aggregation weights (Ye et al., ICML 2023, Eq. 3; spec section 2).

Each participant k gets ``p_k = ReLU(n_k - a·d_k + b) / Σ_j ReLU(n_j - a·d_j + b)`` where ``n_k`` is its share
of the round's training samples and ``d_k`` the discrepancy between its label distribution and a target
distribution T (uniform unless the experiment uses a deliberately imbalanced test set).

Paper vs official code (we follow the code, spec 2.5):

- ``n_k`` and, for ``kl``, ``d_k`` are renormalized over the round's participants every round (paper: computed
  once). Identical under full participation.
- Only ``kl`` is normalized to sum to 1 over participants; ``l1``/``l2``/``cosine``/``only_iid`` are used raw.
- If every raw weight is ``<= 0`` the official code crashes; we fall back to the size weights ``n_k`` (spec
  2.4).

Host algorithms with their own averaging (spec 2.3 step 5): Disco only swaps the per-client weights that the
host's combine receives. With FedAvg/FedProx/MOON/SCAFFOLD use ``Aggregation(DiscoWeights(),
WeightedMean())``; for FedAvgM, FedNova, FedDyn and FedDC feed ``p`` into their own server update in place of
the size (or uniform) weights; their extra state (momentum, drift, control variates) is untouched by Disco.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedskew.protocol import LABEL_HIST, ClientReport, Params, RoundInput, ServerContext, State
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import ConfigError, StrictSettings
from fedskew.seeding import Purpose, numpy_rng
from fedskew.server.api import PrivateWeights, Weighting
from fedskew.space import Float

METRICS = ("kl", "l1", "l2", "cosine", "only_iid")
ONLY_IID_COS = 0.9  # code: a client counts as IID when cos(P_k, T) > 0.9
ONLY_IID_DISTANCE = 0.01  # code: the discrepancy given to IID clients under ``only_iid``


def _finite_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(float(x))


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"unknown FedDisco metric {metric!r}; expected one of {METRICS}")


def _target(target: np.ndarray | tuple[float, ...] | None, num_classes: int, metric: str) -> np.ndarray:
    if target is None:
        return np.full(num_classes, 1.0 / num_classes)
    t = np.asarray(target, dtype=np.float64)
    if t.shape != (num_classes,):
        raise ValueError(f"target has shape {t.shape}, expected ({num_classes},) to match the label histograms")
    if not np.all(np.isfinite(t)) or np.any(t < 0) or not t.sum() > 0:
        raise ValueError(f"target must be finite, non-negative, with a positive sum; got {t.tolist()}")
    if metric == "kl" and np.any(t <= 0):
        raise ValueError(
            "KL discrepancy needs a strictly positive target distribution (a zero entry makes KL infinite); "
            f"smooth it first; got {t.tolist()}"
        )
    return t / t.sum()


def discrepancy(hists: np.ndarray, target: np.ndarray | tuple[float, ...] | None, metric: str = "kl") -> np.ndarray:
    """Raw per-client discrepancy ``D_k = f(h_k / N_k, T)`` (``[K]`` float64), not normalized over clients.

    ``hists`` is ``[K, C]`` label counts (or proportions); ``target`` is ``[C]`` (rescaled to sum 1) or
    ``None`` for uniform. Metrics: ``kl`` = KL(P_k || T) with ``0·log 0 = 0`` (requires T > 0), ``l1``/``l2``
    = norm of ``P_k - T``, ``cosine`` = ``1 - cos(P_k, T)``, ``only_iid`` = 0.01 if ``cos(P_k, T) > 0.9`` else
    ``+inf``. ``kl`` and ``cosine`` are clipped at 0 (round-off can push an exact 0 below it; spec 2.3: d >= 0).
    """
    _check_metric(metric)
    h = np.asarray(hists, dtype=np.float64)
    if h.ndim != 2:
        raise ValueError(f"label histograms must be [K, C], got shape {h.shape}")
    if not np.all(np.isfinite(h)) or np.any(h < 0):
        raise ValueError("label histograms must be finite and non-negative")
    totals = h.sum(axis=1)
    empty = np.flatnonzero(totals <= 0)
    if empty.size:
        raise ValueError(f"clients at rows {empty.tolist()} have an empty label histogram; exclude them from the round")
    p = h / totals[:, None]
    t = _target(target, h.shape[1], metric)
    if metric == "kl":
        ratio = np.where(p > 0, p, 1.0) / t  # entries with P = 0 contribute 0·log(1/T) = 0
        return np.maximum((p * np.log(ratio)).sum(axis=1), 0.0)  # KL >= 0; clip round-off
    if metric == "l1":
        return np.abs(p - t).sum(axis=1)
    if metric == "l2":
        return np.sqrt(((p - t) ** 2).sum(axis=1))
    cos = (p @ t) / (np.linalg.norm(p, axis=1) * np.linalg.norm(t))
    if metric == "cosine":
        # 1 - cos >= 0; clip round-off (a histogram proportional to T can give cos = 1 + 1 ulp, i.e. -2.2e-16)
        return np.maximum(1.0 - cos, 0.0)
    return np.where(cos > ONLY_IID_COS, ONLY_IID_DISTANCE, np.inf)


def discrepancy_bound(target: np.ndarray | tuple[float, ...] | None, num_classes: int, metric: str = "kl") -> float:
    """The largest ``d_k`` :func:`discrepancy` can give a client (its smallest is 0, a histogram proportional to T):
    the range of one client's report, i.e. its sensitivity when a client's data is replaced. Every metric is convex
    in ``P_k`` (``cosine``: ``1 - cos`` is maximal where ``P·T`` is smallest, linear), so the maximum is at a vertex of
    the simplex, a one-class client: ``kl`` ``-log min T``, ``l1`` ``2(1 - min T)``, ``l2`` ``max_c ‖e_c - T‖``,
    ``cosine`` ``1 - min T / ‖T‖``. ``only_iid`` has none (an infinite ``d_k`` drops a client)."""
    _check_metric(metric)
    if metric == "only_iid":
        raise ValueError("FedDisco's only_iid discrepancy is unbounded (an infinite d_k drops a client)")
    return float(discrepancy(np.eye(num_classes), target, metric).max())


class DiscoParams(StrictSettings):
    """FedDisco's hyper-parameters: the one place of their defaults and bounds, read by the ``disco`` plug-in's
    arguments (``-m a=0.4``), :class:`DiscoWeights`, :func:`disco_weights` and the Flower strategy
    (``fedskew.flower.strategies.FedDisco``). ``a = 0.5``, ``b = 0.1`` and ``kl`` are the paper's and the official
    code's defaults; ``target`` ``None`` is the uniform distribution; ``report`` says what each client sends before
    round 1: its discrepancy ``d_k``, computed on the client (default), or its label histogram, from which the server
    computes ``d_k`` (the official code's way; identical weights)."""

    a: float = Field(0.5, ge=0)
    b: float = 0.1
    metric: Literal["kl", "l1", "l2", "cosine", "only_iid"] = "kl"
    target: tuple[float, ...] | None = None
    report: Literal["discrepancy", "histogram"] = "discrepancy"


DISCO = DiscoParams()  # the defaults


class DiscoTerms(NamedTuple):
    """The intermediate quantities of Eq. 3 for one round (all ``[K]`` float64)."""

    n: np.ndarray  # participant-normalized sizes
    d: np.ndarray  # discrepancies as used (kl: normalized over participants)
    raw: np.ndarray  # n - a·d + b (``-inf`` where d is infinite)
    weights: np.ndarray  # final p_k
    fallback: bool  # True when every raw weight was <= 0 and p = n


def disco_terms(
    num_samples: np.ndarray, discrepancies: np.ndarray, *, metric: str, a: float = DISCO.a, b: float = DISCO.b
) -> DiscoTerms:
    """Eq. 3 with its intermediates; see :func:`disco_weights`."""
    _check_metric(metric)
    n = np.asarray(num_samples, dtype=np.float64)
    d = np.asarray(discrepancies, dtype=np.float64)
    if n.ndim != 1 or n.shape != d.shape or n.size == 0:
        raise ValueError(f"num_samples {n.shape} and discrepancies {d.shape} must be non-empty [K] vectors")
    if not np.all(np.isfinite(n)) or np.any(n <= 0):
        raise ValueError(f"num_samples must be finite and positive, got {n.tolist()}")
    if np.any(np.isnan(d)) or np.any(d < 0):
        raise ValueError(f"discrepancies must be non-negative (inf allowed), got {d.tolist()}")
    if np.any(np.isinf(d)) and metric != "only_iid":
        raise ValueError(f"infinite discrepancy with metric {metric!r}: {d.tolist()}")
    n = n / n.sum()
    if metric == "kl":
        total = d.sum()
        d = d / total if total > 0 else np.zeros_like(d)
    inf = np.isinf(d)
    raw = np.where(inf, -np.inf, n - a * np.where(inf, 0.0, d) + b)  # inf·a with a = 0 must still drop the client
    relu = np.maximum(raw, 0.0)
    total = relu.sum()
    if total > 0:
        return DiscoTerms(n, d, raw, relu / total, False)
    return DiscoTerms(n, d, raw, n.copy(), True)


def disco_weights(
    num_samples: np.ndarray, discrepancies: np.ndarray, *, metric: str, a: float = DISCO.a, b: float = DISCO.b
) -> np.ndarray:
    """FedDisco weights ``ReLU(n_k - a·d_k + b)`` normalized over the round's participants (``[K]`` float64).

    ``discrepancies`` are the raw values from :func:`discrepancy`; for ``kl`` they are normalized here to sum
    to 1 over the participants (sum 0, i.e. all IID: every ``d_k = 0``). Infinite discrepancies (``only_iid``)
    give weight 0. If no raw weight is positive the size weights ``n_k`` are returned (the official code has
    no such case).
    """
    return disco_terms(num_samples, discrepancies, metric=metric, a=a, b=b).weights


def released_discrepancy(d: np.ndarray, bound: float, report_noise: float, seed: int) -> np.ndarray:
    """The Gaussian mechanism on each client's ``d_k`` (``[N]``, client ``k`` at row ``k``): ``clip(d_k + z·B·g_k,
    0, B)``, ``g_k`` standard normal from the (seed, client) stream, ``B = bound`` the range of ``d_k`` (its
    sensitivity: a replaced client moves its ``d_k`` by at most ``B``), ``z = report_noise``."""
    d = np.asarray(d, dtype=np.float64)
    noise = np.array([numpy_rng(seed, Purpose.DP_REPORT, k).standard_normal() for k in range(d.shape[0])])
    return np.clip(d + report_noise * bound * noise, 0.0, bound)


DISCREPANCY = "disco_discrepancy"  # the client report of FedDisco's d_k


@dataclass(frozen=True)
class DiscoWeights(Weighting):
    """FedDisco's :class:`~fedskew.server.api.Weighting`: Eq. 3 from the participants' histograms and sizes.

    ``target=None`` means the uniform distribution; otherwise a tuple of ``num_classes`` non-negative numbers
    (rescaled to sum 1; strictly positive for ``kl``). Stateless: the discrepancies are read every round from what the
    clients reported once, which equals computing them once.

    ``report``: what each client sends before round 1 (:attr:`reports`). ``"discrepancy"`` (default): its raw
    ``d_k``, computed on the client from its own histogram and the target (the server learns one number per client);
    ``"histogram"``: its label histogram, from which the server computes ``d_k`` (the official code's way). The
    weights are the same. A :class:`RoundInput` built by hand with ``label_hists`` only is read as ``"histogram"``.
    """

    before_round = True  # Eq. 3 reads the sample counts and the d_k reported before round 1, never an upload
    a: float = DISCO.a
    b: float = DISCO.b
    metric: str = DISCO.metric
    target: tuple[float, ...] | None = DISCO.target
    report: str = DISCO.report

    def __post_init__(self) -> None:
        _check_metric(self.metric)
        if not _finite_real(self.a) or self.a < 0:
            raise ValueError(f"FedDisco a must be a finite number >= 0, got {self.a!r}")
        if not _finite_real(self.b):
            raise ValueError(f"FedDisco b must be a finite number, got {self.b!r}")
        if self.target is not None:
            t = tuple(float(x) for x in self.target)
            _target(t, len(t), self.metric)  # validates values
            object.__setattr__(self, "target", t)
        if self.report not in ("discrepancy", "histogram"):
            raise ValueError(f"FedDisco report must be 'discrepancy' or 'histogram', got {self.report!r}")

    @property
    def reports(self) -> tuple[ClientReport, ...]:
        """What each client sends before round 1 (see the class docstring)."""
        if self.report == "histogram":
            return (LABEL_HIST,)
        return (
            ClientReport(
                DISCREPANCY,
                self._client_discrepancy,
                f"the client's label-distribution discrepancy d_k ({self.metric} to the target): one number",
            ),
        )

    def _client_discrepancy(self, hist: np.ndarray) -> np.ndarray:
        """``d_k`` as the client computes it from its own training label histogram ``[C]``."""
        return discrepancy(np.asarray(hist, dtype=np.float64)[None, :], self.target, self.metric)

    def init(self, ctx: ServerContext | None) -> State:
        if ctx is not None and self.target is not None and len(self.target) != ctx.num_classes:
            raise ValueError(f"target has {len(self.target)} entries but the task has {ctx.num_classes} classes")
        return None

    def terms(self, rin: RoundInput) -> DiscoTerms:
        """This round's Eq. 3 intermediates (for diagnostics), from the participants' reported ``d_k`` or, when the
        histograms were reported instead, computed from them."""
        if DISCREPANCY in rin.reports:
            d = np.asarray(rin.reports[DISCREPANCY], dtype=np.float64).reshape(-1)
            if d.shape[0] != rin.num_participants:
                raise ValueError(f"{DISCREPANCY} has {d.shape[0]} values, expected {rin.num_participants}")
        elif rin.label_hists is not None:
            hists = np.asarray(rin.label_hists, dtype=np.float64)
            if hists.ndim != 2 or hists.shape[0] != rin.num_participants:
                raise ValueError(
                    f"label_hists has shape {hists.shape}, expected [{rin.num_participants}, num_classes] "
                    "(one row per participant)"
                )
            d = discrepancy(hists, self.target, self.metric)
        else:
            raise ValueError(
                f"FedDisco needs each participant's {DISCREPANCY} or label histogram (its declared client report); "
                "the round input carries neither"
            )
        n = rin.num_samples.detach().cpu().to(torch.float64).numpy()
        return disco_terms(n, d, metric=self.metric, a=self.a, b=self.b)

    def __call__(self, rin: RoundInput, masks: Params | None, state: State) -> tuple[Tensor, State]:
        return torch.as_tensor(self.terms(rin).weights, dtype=torch.float64), state

    # ---- under user-level DP (docs/privacy.md) -----------------------------------------------------------------------
    def private_refusal(self) -> str | None:
        if self.metric == "only_iid":
            return "FedDisco's only_iid d_k is unbounded (an infinite d_k drops a client): use kl, l1, l2 or cosine"
        return None

    def private(self, ctx: ServerContext, report_noise: float | None) -> PrivateWeights:
        """Eq. 3 once over the whole federation (the paper's own form: ``n_k`` and, for ``kl``, ``d_k`` normalized
        over every client, as the official code's per-round renormalization gives under full participation), from
        each client's ``d_k`` released through a Gaussian mechanism: ``d̃_k = clip(d_k + N(0, (z_d·B)²), 0, B)``, ``B``
        the range of ``d_k`` (:func:`discrepancy_bound`), the draw keyed by (seed, client). The weights are
        post-processing of the released ``d̃`` and the public sample counts."""
        if report_noise is None:
            raise ConfigError(
                "FedDisco's weights read each client's label-distribution discrepancy d_k, a release of its own: give "
                "it a noise multiplier, dp_report_noise (--dp-report-noise Z; d_k is released once with Gaussian "
                "noise of std Z times its range, composed in the accountant with the rounds)"
            )
        if self.private_refusal() is not None:
            raise ConfigError(str(self.private_refusal()))
        bound = discrepancy_bound(self.target, ctx.num_classes, self.metric)
        released = released_discrepancy(self.population_discrepancy(ctx), bound, report_noise, ctx.seed)
        terms = disco_terms(ctx.num_train, released, metric=self.metric, a=self.a, b=self.b)
        record = {
            "report": "d_k",
            "report_range": bound,
            "report_noise_std": report_noise * bound,
            "size_fallback": terms.fallback,
        }
        return PrivateWeights(terms.weights, "disco", report_noise, record)

    def population_discrepancy(self, ctx: ServerContext) -> np.ndarray:
        """Every client's raw ``d_k`` (``[N]``) from what it reported before round 1."""
        if DISCREPANCY in ctx.reports:
            return np.asarray(ctx.reports[DISCREPANCY], dtype=np.float64).reshape(-1)
        if ctx.label_hists is not None:
            return discrepancy(ctx.label_hists, self.target, self.metric)
        raise ValueError(f"FedDisco needs every client's {DISCREPANCY} or label histogram (its declared report)")


# ---- registration ----------------------------------------------------------------------------------------------------
CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "disco": ServerPlugin(
        "disco",
        "weights ReLU(n_k - a*d_k + b) from dataset size and label-distribution discrepancy (a=0.5, b=0.1, kl)",
        "Ye et al., FedDisco: Federated Learning with Discrepancy-Aware Collaboration, ICML 2023",
        DiscoParams,
        ("weighting",),
        lambda p: {"weighting": DiscoWeights(a=p.a, b=p.b, metric=p.metric, target=p.target, report=p.report)},
        tunable={"a": Float(0.1, 1.0), "b": Float(0.0, 0.2)},  # FedDisco Fig. 4 tunes a and b around 0.5 / 0.1
    ),
}
