"""Server optimizer transforms: momentum (:class:`Ema`, :class:`Trace`) and the server learning rate (:class:`Scale`),
the pieces of a :class:`~fedskew.server.api.Descent` chain (as optax composes them). FedAvgM is one such chain
(:mod:`fedskew.catalog.fedavgm`); FedNova's combine is in :mod:`fedskew.catalog.fednova`, the cloud step of FedDyn
and FedDC in :mod:`fedskew.catalog.drift`.

The momentum transforms keep a buffer ``v`` of the pseudo-gradient ``g = w^t − w̄``: :class:`Ema`
``v ← m·v + (1 − m)·g`` (FedDisco's code), :class:`Trace` ``v ← m·v + g`` (Hsu et al.'s heavy ball); :class:`Scale`
multiplies by the server learning rate η, so ``w^{t+1} = w^t − η·v``.

Each transform is a small frozen dataclass with explicit, typed state (``init(ctx) -> state``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from fedskew.protocol import Params, ServerContext, State
from fedskew.server.api import (
    Diagnostics,
    GradientTransform,
)


def _float_names(params: Params) -> list[str]:
    return [n for n, t in params.items() if t.is_floating_point()]


# ---- FedAvgM ----------------------------------------------------------------------------------------------------
class MomentumState(NamedTuple):
    """A momentum transform's buffer ``v``, one per floating state-dict entry, in the entry's dtype."""

    v: Params


def _check_momentum(momentum: float) -> None:
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"server momentum must be in [0, 1), got {momentum}")


@dataclass(frozen=True)
class _Momentum(GradientTransform):
    momentum: float = 0.9
    form: str = "ema"

    def __post_init__(self) -> None:
        _check_momentum(self.momentum)

    def init(self, ctx: ServerContext) -> MomentumState:
        return MomentumState({n: torch.zeros_like(ctx.template[n]) for n in _float_names(ctx.template)})

    def __call__(self, grads: Params, state: MomentumState) -> tuple[Params, Diagnostics, MomentumState]:
        m = self.momentum
        out: Params = {}
        v_new: Params = {}
        sq = 0.0
        for name, v in state.v.items():
            g = grads[name]
            out[name] = m * v.to(torch.float64) + ((1.0 - m) * g if self.form == "ema" else g)
            v_new[name] = out[name].to(v.dtype)
            sq += float((out[name] ** 2).sum())
        return out, {"momentum_norm": sq**0.5}, MomentumState(v_new)


@dataclass(frozen=True)
class Ema(_Momentum):
    """``v ← m·v + (1 − m)·g`` (FedDisco's FedAvgM; optax's ``ema`` without debiasing)."""

    form: str = "ema"


@dataclass(frozen=True)
class Trace(_Momentum):
    """``v ← m·v + g``, heavy-ball momentum (Hsu et al.'s FedAvgM; optax's ``trace``)."""

    form: str = "hsu"


@dataclass(frozen=True)
class Scale(GradientTransform):
    """``g ← lr·g``: the server learning rate."""

    lr: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"server_lr must be positive, got {self.lr}")

    def __call__(self, grads: Params, state: State) -> tuple[Params, Diagnostics, State]:
        return {n: self.lr * g for n, g in grads.items()}, {}, state
