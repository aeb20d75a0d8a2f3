"""Shared client-side kernels: pieces several client parts compute the same way.

* :func:`trainable` the parameters the model trains now (named), in the model's order;
* :func:`proximal`  ``(mu/2)·Σ‖w − anchor‖²`` over them (FedProx, Ditto's personal phase, FedAMP's client);
* :data:`PERSONAL`  the client-state entry of a client's own model (Ditto, FedAMP, FedBABU), and :func:`is_head`,
  the state-dict names of the classifier head (FedRep's and FedBABU's phases).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedskew.client.local import LocalContext, StateKey
from fedskew.protocol import Params

PERSONAL = StateKey[Params]("personal_model", "the model the client keeps for itself (Ditto, FedAMP, FedBABU)")


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's parameters that train now, with their names."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def proximal(ctx: LocalContext, anchor: Params, mu: float) -> Tensor:
    """``(mu/2)·Σ‖w − anchor‖²`` over the parameters ``ctx.model`` trains now (FedProx, Ditto, FedAMP)."""
    return 0.5 * mu * torch.stack([((p - anchor[n]) ** 2).sum() for n, p in trainable(ctx.model)]).sum()


def is_head(name: str) -> bool:
    """Whether a state-dict entry belongs to the classifier head (every model is ``body`` + ``head``)."""
    return name.startswith("head.")
