"""FedOpt (Reddi et al., Adaptive Federated Optimization, ICLR 2021): FedAdagrad, FedAdam and FedYogi as server steps.

Algorithm 2 of the paper, with ``Δ_t`` the combined update (the weighted mean of the clients' deltas, i.e. the
combined model minus the broadcast one; fedskew's combine gives it, so ``+disco`` or ``+heal`` weights carry over)::

    m_t = β1·m_{t−1} + (1 − β1)·Δ_t
    v_t = v_{t−1} + Δ_t²                                   FedAdagrad
    v_t = v_{t−1} − (1 − β2)·Δ_t²·sign(v_{t−1} − Δ_t²)      FedYogi
    v_t = β2·v_{t−1} + (1 − β2)·Δ_t²                       FedAdam
    x_{t+1} = x_t + η·m_t / (√v_t + τ)

``m_{−1} = 0`` and ``v_{−1} = τ²`` (Algorithm 2 asks ``v_{−1} ≥ τ²``; its smallest value). Each is a
:class:`~fedskew.server.api.Descent` link on the pseudo-gradient ``g = −Δ`` (``m`` of ``g`` is ``−m`` of ``Δ`` and
``v`` is even in ``Δ``, so ``x − η·m_g/(√v + τ)`` is the paper's step), in float64, over the trainable parameters.

The switches, each named after where the other choice comes from:

* ``v_init``: ``tau_squared`` (the paper) or ``zero`` (Flower's ``FedOpt`` and FL-bench start ``v`` at 0);
* ``bias_correction``: ``none`` (the paper, FL-bench), ``adam`` (Kingma & Ba's ``η·√(1 − β2^t)/(1 − β1^t)`` at the
  ``t``-th server step) or ``flower`` (Flower 1.42's ``FedAdam``: the same factor with exponent ``round + 1``);
* ``entries``: ``trainable`` (the model's parameters, as the paper's ``x``; buffers take the combined value) or
  ``all`` (every floating entry, BatchNorm statistics included: Flower's strategies step every array).

Flower's own ``FedAdam`` is ``fedadam`` with ``v_init=zero, bias_correction=flower, entries=all``, its ``FedYogi``
and ``FedAdagrad`` the same without the bias correction (its FedAdagrad has ``β1 = 0``): tests/test_fedopt.py runs
both on the same uploads. Defaults: ``β1 = 0.9``, ``β2 = 0.99``, ``τ = 1e-3`` (the paper's and Flower's), server
learning rate η = 0.1 (Flower's FedAdam and FedAdagrad, FL-bench's); the paper tunes η and τ on a log grid
(``η ∈ 10^[−3, 1]``, ``τ ∈ 10^[−5, −1]``), which is the declared search range.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from pydantic import Field

from fedskew.protocol import Params, ServerContext
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import Descent, Diagnostics, GradientTransform
from fedskew.space import LogFloat

KINDS = ("adagrad", "adam", "yogi")


class FedOptParams(StrictSettings):
    """FedAdagrad's, FedAdam's and FedYogi's hyper-parameters, as the paper names them (``η``, ``β1``, ``β2``,
    ``τ``) and the switches (module docstring). ``beta2`` does not enter FedAdagrad."""

    server_lr: float = Field(0.1, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.99, ge=0, lt=1)
    tau: float = Field(1e-3, gt=0)
    v_init: Literal["tau_squared", "zero"] = "tau_squared"
    bias_correction: Literal["none", "adam", "flower"] = "none"
    entries: Literal["trainable", "all"] = "trainable"


FEDOPT = FedOptParams()  # the defaults


class AdaptiveState(NamedTuple):
    """The server optimizer's moments (float64, one per stepped entry) and how many steps it took."""

    m: Params
    v: Params
    t: int = 0


@dataclass(frozen=True)
class Adaptive(GradientTransform):
    """One FedOpt step on the pseudo-gradients: the moments of ``kind`` (module docstring), then
    ``η·m/(√v + τ)``, the amount the model moves against each gradient."""

    kind: str = "adam"
    server_lr: float = FEDOPT.server_lr
    beta1: float = FEDOPT.beta1
    beta2: float = FEDOPT.beta2
    tau: float = FEDOPT.tau
    v_init: str = FEDOPT.v_init
    bias_correction: str = FEDOPT.bias_correction
    entries: str = FEDOPT.entries  # trainable: the parameters (buffers take the combined value); all: every float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"FedOpt kind must be one of {KINDS}, got {self.kind!r}")
        for what, value, ok in (
            ("server_lr", self.server_lr, self.server_lr > 0),
            ("beta1", self.beta1, 0 <= self.beta1 < 1),
            ("beta2", self.beta2, 0 <= self.beta2 < 1),
            ("tau", self.tau, self.tau > 0),
        ):
            if not (isinstance(value, int | float) and math.isfinite(value) and ok):
                raise ValueError(f"FedOpt {what} is out of range: {value!r}")
        if self.v_init not in ("tau_squared", "zero"):
            raise ValueError(f"FedOpt v_init must be 'tau_squared' or 'zero', got {self.v_init!r}")
        if self.entries not in ("trainable", "all"):
            raise ValueError(f"FedOpt entries must be 'trainable' or 'all', got {self.entries!r}")
        if self.bias_correction not in ("none", "adam", "flower"):
            raise ValueError(f"FedOpt bias_correction must be 'none', 'adam' or 'flower', got {self.bias_correction!r}")

    def init(self, ctx: ServerContext) -> AdaptiveState:
        """The moments of the entries it steps (the others pass through: the combined value)."""
        stepped = ctx.trainable if self.entries == "trainable" else ctx.template
        names = [n for n, t in ctx.template.items() if t.is_floating_point() and n in stepped]
        v0 = self.tau**2 if self.v_init == "tau_squared" else 0.0
        zeros = {n: torch.zeros_like(ctx.template[n], dtype=torch.float64) for n in names}
        return AdaptiveState(m=zeros, v={n: torch.full_like(z, v0) for n, z in zeros.items()})

    def rate(self, t: int) -> float:
        """The step size of the ``t``-th server step (``t`` from 1): ``η``, times the bias correction if any."""
        if self.bias_correction == "none":
            return self.server_lr
        e = t if self.bias_correction == "adam" else t + 1
        return self.server_lr * math.sqrt(1.0 - self.beta2**e) / (1.0 - self.beta1**e)

    def __call__(self, grads: Params, state: AdaptiveState) -> tuple[Params, Diagnostics, AdaptiveState]:
        b1, b2, t = self.beta1, self.beta2, state.t + 1
        rate = self.rate(t)
        out, m_new, v_new = dict(grads), {}, {}  # an entry it does not step keeps g: the combined value
        sq = 0.0
        for name, m in state.m.items():
            g, v = grads[name], state.v[name]
            g2 = g * g
            m_new[name] = b1 * m + (1.0 - b1) * g
            if self.kind == "adagrad":
                v_new[name] = v + g2
            elif self.kind == "adam":
                v_new[name] = b2 * v + (1.0 - b2) * g2
            else:  # yogi
                v_new[name] = v - (1.0 - b2) * g2 * torch.sign(v - g2)
            out[name] = rate * m_new[name] / (v_new[name].sqrt() + self.tau)
            sq += float((out[name] ** 2).sum())
        return out, {"step_norm": sq**0.5, "rate": rate}, AdaptiveState(m_new, v_new, t)


def fedopt(kind: str, **args: object) -> Descent:
    """A FedOpt server step (``kind``: adagrad, adam or yogi; ``args``: :class:`FedOptParams`' fields, checked there);
    diagnostics ``fed<kind>_step_norm`` and ``fed<kind>_rate``."""
    p = FedOptParams(**args)  # type: ignore[arg-type]
    return Descent((("adaptive", Adaptive(kind, **p.model_dump())),), prefix=f"fed{kind}")


# ---- registration ----------------------------------------------------------------------------------------------------
def _build(kind: str) -> Callable[[FedOptParams], dict[str, Descent]]:
    return lambda p: {"step": Descent((("adaptive", Adaptive(kind, **p.model_dump())),), prefix=f"fed{kind}")}


PAPER = "Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan, Adaptive Federated Optimization, ICLR 2021"
TUNABLE = {"server_lr": LogFloat(1e-3, 1.0), "tau": LogFloat(1e-5, 1e-1)}  # the paper's log grids
SUMMARIES = {
    "adagrad": "v <- v + d^2",
    "adam": "v <- b2 v + (1-b2) d^2",
    "yogi": "v <- v - (1-b2) d^2 sign(v - d^2)",
}

CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    f"fed{kind}": ServerPlugin(
        f"fed{kind}",
        f"adaptive server step on the combined update d: m <- b1 m + (1-b1) d, {SUMMARIES[kind]}, "
        "w <- w + lr m/(sqrt(v)+tau) (lr=0.1, b1=0.9, b2=0.99, tau=1e-3)",
        PAPER,
        FedOptParams,
        ("step",),
        _build(kind),
        tunable=TUNABLE,
    )
    for kind in KINDS
}
