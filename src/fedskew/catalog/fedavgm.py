"""FedAvgM (Hsu, Qi, Brown, 2019): server momentum on the averaged update, a server ``step`` plug-in.

The combined model ``w̄`` defines the pseudo-gradient ``g = w^t − w̄``; a momentum transform keeps a buffer ``v`` and
the server learning rate η scales it: ``w^{t+1} = w^t − η·v``. ``form="ema"`` is FedDisco's code,
``v ← m·v + (1 − m)·g``; ``form="hsu"`` is Hsu et al.'s heavy ball, ``v ← m·v + g``. The two are the same method in
two parameterizations (``ema`` with η equals ``hsu`` with ``η·(1 − m)``); both are offered so that a value from either
source can be used as written. ``fedavgm`` alone is ``fedavg+fedavgm``; it composes with any client part
(``fedprox+fedavgm``) and with ``+disco``, whose weights replace the average's (spec §2.3).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.api import Descent
from fedskew.server.optimizers import Ema, Scale, Trace
from fedskew.space import Float


def fedavgm(momentum: float = 0.9, server_lr: float = 1.0, form: Literal["ema", "hsu"] = "ema") -> Descent:
    """FedAvgM's server step: ``ema`` (or ``hsu``: ``trace``) momentum, then ``scale`` by the server learning rate,
    over every floating state-dict entry (FedDisco's code applies it to every key); integer buffers take the combined
    value. Diagnostic: ``fedavgm_momentum_norm``, the norm of the new buffer."""
    if form not in ("ema", "hsu"):
        raise ValueError(f"form must be 'ema' or 'hsu', got {form!r}")
    trace = Ema(momentum) if form == "ema" else Trace(momentum)
    return Descent((("momentum", trace), ("scale", Scale(server_lr))), prefix="fedavgm")


# ---- registration ----------------------------------------------------------------------------------------------------
class FedAvgMParams(StrictSettings):
    # Hsu et al.'s server momentum (FedDisco tunes it, values stripped; its code's default 0 turns it off)
    server_momentum: float = Field(0.9, ge=0, lt=1)
    server_lr: float = Field(1.0, gt=0)
    form: Literal["ema", "hsu"] = "ema"  # ema: FedDisco's code; hsu: v <- m v + delta (Hsu et al.)


CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "fedavgm": ServerPlugin(
        "fedavgm",
        "server momentum on the averaged update: v <- m v + (1-m)(w - w_avg), w <- w - lr v (m=0.9, ema form; "
        "form=hsu: v <- m v + (w - w_avg))",
        "Hsu, Qi, Brown, Measuring the Effects of Non-Identical Data Distribution for Federated Visual "
        "Classification, arXiv 1909.06335, 2019",
        FedAvgMParams,
        ("step",),
        lambda p: {"step": fedavgm(momentum=p.server_momentum, server_lr=p.server_lr, form=p.form)},
        tunable={"server_momentum": Float(0.0, 0.97)},  # Hsu et al. sweep beta up to 0.97; FedDisco tunes m
    ),
}
