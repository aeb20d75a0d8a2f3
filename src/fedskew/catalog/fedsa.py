"""FedSA / FedPake, whole: parameter-skew-aware aggregation ("The Key of Parameter Skew in Federated
Learning", arXiv 2408.11278 v1 = FedSA, v2 = FedPake; spec section 1).

FedPake replaces the server's weighted average, independently for every trainable parameter tensor (a
"layer", flattened to ``M`` positions; spec 1.4 / A9). With the K uploaded copies stacked as ``X``
(``K x M``, row k = client k; all statistics in float64, spec 0.3):

1. ``mu`` = client mean, ``D = (X - mu)^2``, ``sigma = sqrt(mean_k D)`` (population std); ``cv = 0`` where
   the column is constant (min == max over the clients, exactly; spec 7), else ``sigma / max(|mu|, eps)``
   (spec 1.3 step 2.3, A1).
2. Parameter division: min-max normalized cv ``z`` (or ``cv_norm='rank'``: ``rank / (M - 1)``);
   high-dispersion region ``r^h = {z > lam}``, ``H = |r^h|`` (step 2.4). ``H = 0`` or ``K < 2``: the layer
   is the low-region mean (step 2.5).
3. Micro-classes on the ``K x H`` block ``B = D[:, r^h]``, normalized by ``micro_norm`` and binned at
   ``i / C`` (upper-inclusive, zeros in class 1, values above 1 clamped to class C; step 2.6, A3, A4,
   spec 7).
4. ``SIM(a, b) = 1 - #{m in r^h: E_am != E_bm} / H`` (step 2.7, A5), then the deterministic capped
   agglomerative :func:`cluster` (v1 Steps 1-3, A6) into at most ``S`` macro-classes plus unclustered
   clients.
5. Per cluster: modal class ``Q_j`` (ties -> smallest), ``f_j(c)`` = share of high positions with modal
   class c, ``alpha_jm = f_j(Q_jm) / S`` (v2 Eq. 11), normalized per position over the clusters
   (``alpha_norm='per_position'``, A8) or used as written (``'literal'``); cluster means ``wbar_j``
   (unweighted).
6. Output: ``r^l`` -> mean over **all** K participants (``low_weighting='uniform'``) or the sample-weighted
   mean (``'samples'``, A10); ``r^h`` -> ``sum_j alpha_j * wbar_j`` (unclustered clients do not contribute).

Deviations from the paper (all from the spec, which documents the reasons):

- ``|mu|`` in cv with an ``eps`` guard, and cv = 0 for constant columns (A1, spec 7); v2 writes the signed
  mean.
- Squared deviations are min-max normalized over the layer's high block before binning
  (``micro_norm='layer_minmax'``, A3); ``'raw'`` is the literal rule, which degenerates to one cluster
  on real weights.
- Similarity counted over ``r^h`` only (A5); clustering per v1 Steps 1-3 with average linkage over all
  members, no cluster-cluster merges, ``delta`` applied only once S clusters exist, strict ``>`` (A6).
- Similarity comparisons use an absolute tolerance of ``1e-12`` (spec 7): candidates within ``1e-12`` of the
  best are ties (JOIN before PAIR, then lower cluster index, then lower client ids), and a similarity within
  ``1e-12`` of ``delta`` does not "exceed" it. Class bins use ``ceil(C * b' - 1e-12)`` so a value that lands
  a rounding error above an edge ``i / C`` stays in class i (A4).
- alpha renormalized per position (A8); v1 Eq. 14 and v2 Eq. 11 weights do not sum to 1.
- Buffers are not covered by the paper: ``buffers='mean'`` (float buffers plain mean, integer buffers max)
  or ``'local'`` (the combine returns the broadcast value; the engine keeps each client's buffers; step 3).
- ``cv_norm='rank'`` is our ablation (A2). In both cv modes a layer whose cv is constant
  (``max cv == min cv``, which includes ``M = 1`` and ``K = 1``) has an empty high region.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedskew.protocol import Params, RoundInput, State
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import ConfigError, StrictSettings
from fedskew.server.api import Combine, Composition, Diagnostics, refuse_masks
from fedskew.server.dispersion import CV_NORMS, EPS, column_stats, cv_of, high_dispersion
from fedskew.space import Float, Int

MICRO_NORMS = ("layer_minmax", "position_max", "raw")
ALPHA_NORMS = ("per_position", "literal")
LOW_WEIGHTINGS = ("uniform", "samples")
BUFFER_MODES = ("mean", "local")

SIM_TOL = 1e-12  # absolute tolerance for similarity ties (spec 7)
BIN_TOL = 1e-12  # C * b' within this of an integer i counts as the edge i / C (upper-inclusive bins, A4)


def micro_classes(B: Tensor, C: int, micro_norm: str = "layer_minmax") -> Tensor:
    """Micro-class ``E`` in ``1..C`` (int64, ``K x H``) of each squared deviation in ``B`` (step 2.6).

    ``layer_minmax``: min-max over the whole block (constant block -> 0); ``position_max``: divide each column
    by its largest entry (0/0 -> 0); ``raw``: no normalization. Class ``i`` <=> ``(i-1)/C < b' <= i/C``;
    ``b' <= 0`` -> class 1, ``b' > 1`` -> class C.
    """
    if micro_norm not in MICRO_NORMS:
        raise ValueError(f"unknown micro_norm {micro_norm!r}; expected one of {MICRO_NORMS}")
    B = torch.as_tensor(B, dtype=torch.float64)
    if B.numel() == 0:
        return torch.ones(B.shape, dtype=torch.int64, device=B.device)
    if micro_norm == "layer_minmax":
        bmin, bmax = torch.aminmax(B)
        span = float(bmax - bmin)
        Bn = (B - bmin) / span if span > 0 else torch.zeros_like(B)
    elif micro_norm == "position_max":
        colmax = B.amax(0, keepdim=True)
        Bn = torch.where(colmax > 0, B / torch.where(colmax > 0, colmax, torch.ones_like(colmax)), 0.0)
    else:
        Bn = B
    return torch.ceil(Bn * C - BIN_TOL).clamp_(1, C).to(torch.int64)


def similarity(E: Tensor, C: int) -> Tensor:
    """``SIM`` (``K x K`` float64): share of the H columns of ``E`` (classes ``1..C``) where 2 clients agree.

    Computed as ``sum_c A_c A_c^T`` with ``A_c = (E == c)`` (C matmuls of ``K x H``; no loop over positions).
    """
    E = torch.as_tensor(E)
    k, h = E.shape
    if h == 0:
        return torch.ones((k, k), dtype=torch.float64, device=E.device)
    counts = torch.zeros((k, k), dtype=torch.float64, device=E.device)
    for c in range(1, C + 1):
        A = E.eq(c).to(torch.float64)
        counts += A @ A.T
    sim = counts / h
    sim.fill_diagonal_(1.0)
    return sim


# ----------------------------------------------------------------------------------------------- clustering


def cluster(
    sim: Tensor | np.ndarray | Sequence[Sequence[float]], S: int, delta: float, tol: float = SIM_TOL
) -> tuple[list[list[int]], list[int]]:
    """CLUSTER(SIM, S, delta) of spec 1.3 (v1 Steps 1-3, deterministic).

    Repeatedly takes the most similar candidate among JOIN(cluster g, free client k) with average linkage
    ``mean_{a in g} SIM[a, k]`` and, while fewer than ``S`` clusters exist, PAIR(free a < free b) with
    ``SIM[a, b]``. Candidates within ``tol`` of the best are ties, broken by JOIN before PAIR, then lower
    cluster index, then lower client ids. A PAIR opens a cluster; a JOIN before the cap is always accepted;
    once ``S`` clusters exist a JOIN needs ``similarity > delta`` (strict, with ``tol``), otherwise every
    remaining client is unclustered. Returns ``(clusters, unclustered)``: member lists in joining order, and
    sorted client ids.
    """
    if isinstance(S, bool) or not isinstance(S, numbers.Integral) or S < 1:
        raise ValueError(f"S must be an integer >= 1, got {S!r}")
    if isinstance(sim, Tensor):
        sim = sim.detach().cpu().numpy()
    s = np.asarray(sim, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != s.shape[1]:
        raise ValueError(f"SIM must be a square matrix, got shape {s.shape}")
    k = s.shape[0]
    is_free = np.ones(k, dtype=bool)
    upper = np.triu(np.ones((k, k), dtype=bool), 1)
    groups: list[list[int]] = []
    sums = np.zeros((0, k))  # row j: sum over the members of cluster j of SIM[a, :]
    sizes = np.zeros(0)
    unclustered: list[int] = []
    while is_free.any():
        join = np.where(is_free, sums / sizes[:, None], -np.inf) if groups else None
        pairs = None
        if len(groups) < S and int(is_free.sum()) >= 2:
            pairs = np.where(upper & is_free[:, None] & is_free[None, :], s, -np.inf)
        if join is None and pairs is None:  # only when K = 1
            unclustered.extend(np.flatnonzero(is_free).tolist())
            break
        best_join = float(join.max()) if join is not None else -math.inf
        best = max(best_join, float(pairs.max()) if pairs is not None else -math.inf)
        cut = best - tol
        if join is not None and best_join >= cut:
            # first in row-major order: lowest cluster index, then lowest client id
            j, c = (int(v) for v in np.argwhere(join >= cut)[0])
            if len(groups) < S or float(join[j, c]) > delta + tol:
                groups[j].append(c)
                sums[j] += s[c]
                sizes[j] += 1
                is_free[c] = False
            else:
                unclustered.extend(np.flatnonzero(is_free).tolist())
                break
        else:
            assert pairs is not None
            a, b = (int(v) for v in np.argwhere(pairs >= cut)[0])  # lexicographic (a, b), a < b
            groups.append([a, b])
            sums = np.vstack([sums, s[a] + s[b]])
            sizes = np.append(sizes, 2.0)
            is_free[a] = is_free[b] = False
    return groups, sorted(unclustered)


# ----------------------------------------------------------------------------------------------- one layer


def modal_classes(E: Tensor, C: int) -> Tensor:
    """Most frequent class per column of ``E`` (``n x H``, classes ``1..C``); ties -> smallest class (A7)."""
    E = torch.as_tensor(E, dtype=torch.int64)
    counts = torch.zeros((C, E.shape[1]), dtype=torch.int64, device=E.device)
    counts.scatter_add_(0, E - 1, torch.ones_like(E))
    return counts.argmax(0) + 1  # argmax returns the first maximal index


@dataclass(frozen=True)
class LayerDiagnostics:
    """What FedSA did on one layer.

    ``skew`` is the mean over the layer's non-constant positions of the absolute Fisher-Pearson skewness
    ``|g1|``, ``g1 = m3 / m2^1.5`` with population central moments taken across the K clients' values at that
    position (the paper's "parameter skew": the distribution of one parameter over client models is skewed);
    ``skew_signed`` is the mean of ``g1`` itself. Both are 0 when every position is constant (e.g. K = 1);
    ``|g1| <= (K - 2) / sqrt(K - 1)``. Baseline: for Gaussian client values ``skew`` is not 0 but about
    0.46 / 0.37 / 0.26 for K = 10 / 20 / 50 (sampling noise of g1); compare against that, or use
    ``skew_signed`` for a systematic direction. The other fields are intermediates for tests and inspection.
    """

    M: int
    H: int
    macro: int
    unclustered: int
    skew: float
    skew_signed: float
    high_index: Tensor | None = field(default=None, repr=False)  # [H] positions of r^h
    classes: Tensor | None = field(default=None, repr=False)  # [K, H] micro-classes E
    clusters: list[list[int]] = field(default_factory=list)
    unclustered_ids: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, int | float]:
        """The JSON-serializable summary (python ints and floats)."""
        return {
            "M": int(self.M),
            "H": int(self.H),
            "macro": int(self.macro),
            "unclustered": int(self.unclustered),
            "skew": float(self.skew),
            "skew_signed": float(self.skew_signed),
        }


def fedsa_layer(
    X: Tensor,
    *,
    lam: float = 0.2,
    delta: float = 0.2,
    C: int = 4,
    S: int = 4,
    micro_norm: str = "layer_minmax",
    alpha_norm: str = "per_position",
    cv_norm: str = "minmax",
    low_weights: Tensor | None = None,
    eps: float = EPS,
) -> tuple[Tensor, LayerDiagnostics]:
    """FedSA on one flattened layer ``X`` (``K x M``, row = client): returns the ``[M]`` float64 aggregate.

    ``low_weights`` (``[K]``, non-negative, normalized here): the low-dispersion region takes this weighted
    mean instead of the plain mean (``low_weighting='samples'``, A10), and so does the whole layer when
    ``H = 0`` (spec 1.3 step 2.5); the statistics and the cluster means stay unweighted.
    """
    if alpha_norm not in ALPHA_NORMS:
        raise ValueError(f"unknown alpha_norm {alpha_norm!r}; expected one of {ALPHA_NORMS}")
    X = torch.as_tensor(X)
    if X.ndim != 2 or X.shape[0] < 1 or not X.is_floating_point():
        raise ValueError(f"FedSA needs a floating-point K x M matrix, got {X.dtype} {tuple(X.shape)}")
    for hp_name, hp in (("C", C), ("S", S)):
        if isinstance(hp, bool) or not isinstance(hp, numbers.Integral) or hp < 1:
            raise ValueError(f"{hp_name} must be an integer >= 1, got {hp!r}")
    k, m = X.shape
    w = None
    if low_weights is not None:
        w = torch.as_tensor(low_weights, dtype=torch.float64, device=X.device).reshape(-1)
        if w.numel() != k or bool((w < 0).any()) or not float(w.sum()) > 0:
            raise ValueError(f"low_weights must be {k} non-negative numbers with a positive sum, got {w.tolist()}")
        w = w / w.sum()
    stats = column_stats(X, weights=w)
    nonconst = ~stats.constant
    n_nonconst = int(nonconst.sum())
    if n_nonconst:
        skew = float(stats.skew[nonconst].abs().mean())
        skew_signed = float(stats.skew[nonconst].mean())
    else:
        skew = skew_signed = 0.0
    low = stats.mean if stats.weighted_mean is None else stats.weighted_mean

    if k >= 2:
        high = high_dispersion(cv_of(stats, eps), lam, cv_norm)
    else:
        high = torch.zeros(m, dtype=torch.bool, device=X.device)
    high_index = torch.nonzero(high).reshape(-1)
    h = int(high_index.numel())
    if h == 0:
        return low.clone(), LayerDiagnostics(m, 0, 0, 0, skew, skew_signed, high_index)

    Xh = X[:, high_index].to(torch.float64)  # K x H
    mu_h = stats.mean[high_index]  # exact on constant columns, so their squared deviations are exactly 0
    const_h = stats.constant[high_index]  # (a constant column can be high under cv_norm='rank')
    E = micro_classes((Xh - mu_h).square(), C, micro_norm)
    groups, uncl = cluster(similarity(E, C), S, delta)
    alphas, means = [], []
    for g in groups:
        idx = torch.tensor(g, dtype=torch.int64, device=X.device)
        q = modal_classes(E[idx], C)  # [H]
        f = torch.bincount(q - 1, minlength=C).to(torch.float64) / h  # f_j(c), c = 1..C
        alphas.append(f[q - 1] / S)
        means.append(torch.where(const_h, mu_h, Xh[idx].mean(0)))
    alpha = torch.stack(alphas)  # [J, H]
    if alpha_norm == "per_position":
        alpha = alpha / alpha.sum(0, keepdim=True)  # > 0: f_j(Q_jm) >= 1/H
    out = low.clone()
    out[high_index] = (alpha * torch.stack(means)).sum(0)
    diag = LayerDiagnostics(m, h, len(groups), len(uncl), skew, skew_signed, high_index, E, groups, uncl)
    return out, diag


# ----------------------------------------------------------------------------------------------- combine


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class FedSAParams(StrictSettings):
    """FedSA/FedPake's hyper-parameters: the one place of their defaults and bounds, read by the ``fedsa`` plug-in's
    arguments, :class:`FedSACombine` and the Flower strategy (``fedskew.flower.strategies.FedSA``). Defaults: the
    paper's CIFAR-10 values ``lam = delta = 0.2``, ``C = S = 4`` (spec 1.6); the switches: spec 1.5."""

    lam: float = Field(0.2, ge=0, le=1)
    delta: float = 0.2
    C: int = Field(4, ge=1)
    S: int = Field(4, ge=1)
    micro_norm: Literal["layer_minmax", "position_max", "raw"] = "layer_minmax"
    alpha_norm: Literal["per_position", "literal"] = "per_position"
    low_weighting: Literal["uniform", "samples"] = "uniform"
    buffers: Literal["mean", "local"] = "mean"
    cv_norm: Literal["minmax", "rank"] = "minmax"


FEDSA = FedSAParams()  # the defaults


@dataclass(frozen=True)
class FedSACombine(Combine):
    """FedSA / FedPake as a :class:`~fedskew.server.api.Combine` (spec 1.3-1.6).

    Every **trainable** tensor (``rin.trainable``) goes through :func:`fedsa_layer`, flattened. Buffers
    (spec 1.3 step 3): ``'mean'`` -> float buffers plain mean over the participants, integer buffers
    (``num_batches_tracked``) max; ``'local'`` -> the broadcast value ``rin.global_params[name]`` is returned
    unchanged, and the engine is expected to keep each client's own buffers (PFLlib behaviour, spec 1.7).

    ``low_weighting='samples'`` takes the low-dispersion mean with the ``weights`` handed to the combine
    (the engine passes sample shares); ``'uniform'`` ignores them (the paper's equations). Element ``masks``
    are not supported. Defaults: the paper's CIFAR-10 values ``lam = delta = 0.2``, ``C = S = 4`` (spec 1.6).

    Diagnostics: ``{"fedsa": {name: LayerDiagnostics.as_dict()}, "fedsa_high_frac": sum H / sum M,
    "fedsa_skew": M-weighted mean of the layers' skew}`` (JSON-serializable).
    """

    lam: float = FEDSA.lam
    delta: float = FEDSA.delta
    C: int = FEDSA.C
    S: int = FEDSA.S
    micro_norm: str = FEDSA.micro_norm
    alpha_norm: str = FEDSA.alpha_norm
    low_weighting: str = FEDSA.low_weighting
    buffers: str = FEDSA.buffers
    cv_norm: str = FEDSA.cv_norm
    eps: float = EPS

    def __post_init__(self) -> None:
        if not _is_real(self.lam) or not 0.0 <= float(self.lam) <= 1.0:
            raise ValueError(f"FedSA lam must be a number in [0, 1], got {self.lam!r}")
        if not _is_real(self.delta) or math.isnan(float(self.delta)):
            raise ValueError(f"FedSA delta must be a number (-inf allowed), got {self.delta!r}")
        if not _is_int(self.C) or self.C < 1:
            raise ValueError(f"FedSA C (number of micro-classes) must be an integer >= 1, got {self.C!r}")
        if not _is_int(self.S) or self.S < 1:
            raise ValueError(f"FedSA S (max number of macro-classes) must be an integer >= 1, got {self.S!r}")
        if not _is_real(self.eps) or not float(self.eps) > 0:
            raise ValueError(f"FedSA eps must be a positive number, got {self.eps!r}")
        for fname, allowed in (
            ("micro_norm", MICRO_NORMS),
            ("alpha_norm", ALPHA_NORMS),
            ("low_weighting", LOW_WEIGHTINGS),
            ("buffers", BUFFER_MODES),
            ("cv_norm", CV_NORMS),
        ):
            value = getattr(self, fname)
            if value not in allowed:
                raise ValueError(f"FedSA {fname} must be one of {allowed}, got {value!r}")

    def check_composition(self, comp: Composition) -> None:
        """No element masks; and with ``low_weighting='uniform'`` no client weights, which it would ignore."""
        refuse_masks(comp, "FedSA's combine takes no element masks")
        if self.low_weighting == "uniform" and ("weighting" in comp.roles or comp.weights_given):
            raise ConfigError(
                f"method {comp.method!r}: FedSA with low_weighting=uniform ignores client weights; "
                "add -m low_weighting=samples to use them in the low-dispersion mean"
            )

    def __call__(
        self, rin: RoundInput, weights: Tensor, masks: Params | None, state: State
    ) -> tuple[Params, Diagnostics, State]:
        if masks is not None:
            raise ValueError("FedSACombine does not support element masks (FedSA is not used with masking)")
        k = rin.num_participants
        low_weights = None
        if self.low_weighting == "samples":
            low_weights = torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
            if low_weights.numel() != k:
                raise ValueError(f"expected {k} client weights, got {low_weights.numel()}")
        out: Params = {}
        layers: dict[str, dict[str, int | float]] = {}
        total_m = total_h = 0
        skew_sum = 0.0
        for name, stacked in rin.params.items():
            if name in rin.trainable:
                if not stacked.is_floating_point():
                    raise ValueError(f"trainable tensor '{name}' is not floating point ({stacked.dtype})")
                lw = None if low_weights is None else low_weights.to(stacked.device)
                vec, diag = fedsa_layer(
                    stacked.reshape(k, -1),
                    lam=self.lam,
                    delta=self.delta,
                    C=self.C,
                    S=self.S,
                    micro_norm=self.micro_norm,
                    alpha_norm=self.alpha_norm,
                    cv_norm=self.cv_norm,
                    low_weights=lw,
                    eps=self.eps,
                )
                out[name] = vec.reshape(stacked.shape[1:]).to(stacked.dtype)
                layers[name] = diag.as_dict()
                total_m += diag.M
                total_h += diag.H
                skew_sum += diag.skew * diag.M
            elif self.buffers == "local":
                out[name] = rin.global_params[name].clone()
            elif stacked.is_floating_point():
                out[name] = stacked.to(torch.float64).mean(0).to(stacked.dtype)
            else:
                out[name] = stacked.max(0).values
        diagnostics: dict[str, Any] = {
            "fedsa": layers,
            "fedsa_high_frac": float(total_h / total_m) if total_m else 0.0,
            "fedsa_skew": float(skew_sum / total_m) if total_m else 0.0,
        }
        return out, diagnostics, state


# ---- registration ----------------------------------------------------------------------------------------------------
def _fedsa(p: FedSAParams) -> dict[str, Any]:
    pieces: dict[str, Any] = {"combine": FedSACombine(**p.model_dump())}
    if p.buffers == "local":  # the engine keeps each client's buffers (step 3 of the combine's docstring)
        pieces["local"] = frozenset({"buffers"})
    return pieces


CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "fedsa": ServerPlugin(
        "fedsa",
        "parameter-skew-aware aggregation: CV split, Micro/Macro-Class clustering (lam=delta=0.2, C=S=4)",
        "The Key of Parameter Skew in Federated Learning (FedSA, arXiv 2408.11278 v1; FedPake, v2)",
        FedSAParams,
        ("combine",),
        _fedsa,
        tunable={"lam": Float(0.1, 0.5), "C": Int(2, 8), "S": Int(2, 8)},  # FedPake Fig. 4: lam, C, S
    ),
}
ALIASES = {"fedpake": "fedsa"}
