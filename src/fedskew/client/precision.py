"""The arithmetic of a client's training passes: the ``precision`` setting.

``float32`` (the default) computes everything in float32. ``bf16`` runs the forward passes of local training and their
losses under ``torch.autocast`` with bfloat16: matrix products and convolutions (and, through autograd, their
gradients) in bfloat16, which a GPU's tensor cores run several times faster than float32; what autocast keeps in
float32 stays there (the losses, softmax, reductions, norms). The parameters, their gradients, the optimizer, every
state a client keeps, the server's aggregation and every evaluation stay float32: there are no bfloat16 copies of the
weights to keep in step, and because bfloat16 has float32's exponent range no loss scaling is needed (float16 would
need it, and a gradient scaler interleaved with every method's gradient changes: SCAFFOLD's correction, FedDyn's
pull, clipping, DP; it is not offered).

Which passes: each step's forward and loss in the one training loop (:func:`fedskew.client.local.local_train`, with
the loss hooks it calls: MOON's and FedNTD's frozen models, FedGen's generated features), FedSAM's second pass, and the
same passes of the batched step functions (:mod:`fedskew.engine.stacked`, :mod:`fedskew.engine.step_functions`,
captured graphs too; the prototype methods collect their features from these passes, in float64). A method's own
passes outside the step (FedALA's weight learning, FedPAC's feature pass, FedAS's alignment and Fisher passes) run in
float32.

Autocast's weight cache is off: a captured CUDA graph must not keep a cast made outside it, and the stacked step
reads each weight once.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

PRECISIONS = ("float32", "bf16")
# the devices whose autocast runs bfloat16 (torch.autocast's device types)
_AUTOCAST_DEVICES = ("cuda", "cpu", "xpu", "mps")


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else ``ValueError`` naming them."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    return precision


def autocast(device: torch.device | str, precision: str) -> AbstractContextManager[object]:
    """The context a training pass on ``device`` runs in: nothing for ``float32``, bfloat16 autocast for ``bf16``."""
    if check_precision(precision) == "float32":
        return nullcontext()
    kind = torch.device(device).type
    if kind not in _AUTOCAST_DEVICES:
        raise ValueError(f"precision bf16: torch has no autocast for device type {kind!r}")
    if kind == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("precision bf16: this GPU has no bfloat16 arithmetic (Ampere or later has): use float32")
    return torch.autocast(kind, dtype=torch.bfloat16, cache_enabled=False)


__all__ = ["PRECISIONS", "autocast", "check_precision"]
