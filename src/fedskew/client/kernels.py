"""Shared client-side kernels: pieces several client parts compute the same way.

* :func:`trainable` the parameters the model trains now (named), in the model's order;
* :func:`proximal`  ``(mu/2)·Σ‖w − anchor‖²`` over them (FedProx, Ditto's personal phase, FedAMP's client);
* :data:`PERSONAL`  the client-state entry of a client's own model (Ditto, FedAMP, FedBABU), and :func:`is_head`,
  the state-dict names of the classifier head (FedRep's and FedBABU's phases);
* :func:`check_linear_head` refuses a model whose head is not one affine layer (FedRoD and FedDBE fold their
  personal parts into it), :func:`leaf_copy` and :func:`sgd_leaves` train tensors a part owns beside the model,
  :func:`forward_with` runs the model with other parameters (APFL, Per-FedAvg, pFedMe).
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


HEAD_WEIGHT, HEAD_BIAS = "head.weight", "head.bias"


def check_linear_head(template: Params, who: str) -> None:
    """Refuse a model whose classifier head is not one ``Linear`` layer with a bias (``head.weight`` ``[C, d]``,
    ``head.bias`` ``[C]``): ``who`` folds its client's personal part into that layer (an affine map)."""
    heads = sorted(n for n in template if is_head(n))
    if heads != [HEAD_BIAS, HEAD_WEIGHT] or template[HEAD_WEIGHT].dim() != 2 or template[HEAD_BIAS].dim() != 1:
        raise ValueError(
            f"{who} needs a model whose head is one Linear layer with a bias (head.weight, head.bias); this model's "
            f"head holds {heads or 'nothing'}"
        )


def check_composite_head(template: Params, needed: set[str], who: str, what: str) -> None:
    """Refuse a model whose head lacks the ``needed`` entries of ``who``'s composite head (``what`` it holds): the
    model must be built with the method's ``model_options`` (``build_model(..., head_module=...)``)."""
    if not needed <= set(template):
        raise ValueError(
            f"{who} trains its composite head ({what}); this model lacks {sorted(needed - set(template))}: build it "
            "with build_model(..., **method.model_options)"
        )


def leaf_copy(tensors: Params) -> Params:
    """Detached copies of ``tensors`` that require a gradient: values a client part trains beside the model (FedRoD's
    personal head, FedDBE's representation bias), stepped by :func:`sgd_leaves`."""
    return {n: t.detach().clone().requires_grad_(True) for n, t in tensors.items()}


@torch.no_grad()
def sgd_leaves(leaves: Params, lr: float) -> None:
    """One plain SGD step on ``leaves`` (``t ← t − lr·∇t``, no momentum), clearing their gradients; a leaf without a
    gradient is left as it is (as ``torch.optim.SGD`` leaves it)."""
    for t in leaves.values():
        if t.grad is not None:
            t.sub_(t.grad, alpha=lr)
            t.grad = None


def forward_with(model: nn.Module, params: Params, x: Tensor) -> Tensor:
    """The logits of ``model`` run with ``params`` in place of its parameters (differentiable in them), its buffers
    copied so that a BatchNorm layer's running statistics in the model do not move (APFL's mixed model, Per-FedAvg's
    adapted one, pFedMe's personalized one)."""
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return torch.func.functional_call(model, {**params, **buffers}, (x,))
