"""The step function of a batch of clients (:mod:`fedskew.engine.batched`): the stacked autograd graph for models of
standard layers (:mod:`fedskew.engine.stacked`), ``vmap(grad(loss))`` of one client's step for any other model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from fedskew.client.batched_form import ClientTerm, FrozenTermFn, HeadTermFn, map_logits
from fedskew.client.precision import autocast, check_precision
from fedskew.engine.stacked import stackable
from fedskew.engine.stacked_step import stacked_step_function


def step_function(
    model: nn.Module,
    names: list[str],
    mu: float,
    term: FrozenTermFn | None = None,
    head_term: HeadTermFn | None = None,
    client_term: ClientTerm | None = None,
    head_draw: str | None = None,
    conv: str = "grouped",
    precision: str = "float32",
) -> Callable[..., Any]:
    """One step of all clients: their gradients of the cross-entropy of ``head(body(x))`` (+ FedProx's proximal
    term), their losses and their buffers after the forward pass (BatchNorm running statistics). Models made of the
    layers :mod:`fedskew.engine.stacked` knows run as one plain autograd graph over the stacked rows, a client's own
    term (``client_term``) by its stacked form and a head's draws passed as its keyword ``head_draw``; any other model,
    and a client term without a stacked form, as ``vmap(grad(loss))`` of one client's step. ``conv``: the stacked
    graph's convolutions' form (:data:`~fedskew.engine.stacked.CONV_FORMS`; ``vmap`` batches a convolution its own
    way). ``precision``: the forward passes' and losses' arithmetic (:mod:`fedskew.client.precision`)."""
    per_client = client_term is not None and client_term.stacked is None
    if not runs_under_vmap(model, per_client):
        stacked_term = None if client_term is None else client_term.stacked
        return stacked_step_function(model, names, mu, term, head_term, conv, precision, stacked_term, head_draw)
    if client_term is not None or head_draw is not None:
        if term is not None or head_term is not None:
            raise ValueError("a term computed one client at a time does not combine with a term on stacked clients")
        return vmap_step_function(model, names, mu, client_term, head_draw, precision)
    if term is not None or head_term is not None:
        raise ValueError(
            "a loss term against frozen models or through the head is batched for models of standard layers only"
        )
    return vmap_step_function(model, names, mu, precision=precision)


def runs_under_vmap(model: nn.Module, per_client: bool) -> bool:
    """Whether :func:`step_function` runs ``model``'s step as ``vmap(grad(loss))``: for a client term without a
    stacked form (``per_client``), or a model with layers the stacked graph lacks."""
    return per_client or stackable(model.body) is not None or stackable(model.head) is not None


def vmap_step_function(
    model: nn.Module,
    names: list[str],
    mu: float,
    client_term: ClientTerm | None = None,
    head_draw: str | None = None,
    precision: str = "float32",
) -> Callable[..., Any]:
    """``vmap(grad(loss))`` of one client's step (any model): the contract of :func:`step_function`; ``client_term``
    added to each client's loss (its ``reads`` rows passed as ``reads=``); ``head_draw``: the keyword of the head's
    forward the step's draws (``head_draws=``) go to; ``precision``: as :func:`step_function`'s."""
    body_prefix, head_prefix = "body.", "head."
    check_precision(precision)

    def client_loss(
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        anchor: dict[str, Tensor],
        x: Tensor,
        y: Tensor,
        scale: Tensor | None,
        shift: Tensor | None,
        reads: dict[str, Tensor] | None,
        head_draws: Tensor | None,
    ) -> tuple[Tensor, tuple[Tensor, dict[str, Tensor]]]:
        state = {**params, **{k: v.clone() for k, v in buffers.items()}}  # the forward updates its own copies
        body = {k[len(body_prefix) :]: v for k, v in state.items() if k.startswith(body_prefix)}
        head = {k[len(head_prefix) :]: v for k, v in state.items() if k.startswith(head_prefix)}
        with autocast(x.device, precision):  # the forward and loss in the run's precision (client/precision.py)
            feats = functional_call(model.body, body, (x,))
            kwargs = {} if head_draw is None else {head_draw: head_draws}  # FedCP's Gumbel noise, drawn outside
            logits = functional_call(model.head, head, (feats,), kwargs)
            loss = F.cross_entropy(map_logits(logits, scale, shift), y)
            if client_term is not None:  # the client's own term (GPFL's valve path, FedCP's MMD)
                loss = loss + client_term.fn(model, state, feats, y, x, reads or {})
        if mu != 0:  # FedProx.loss: ce + proximal(ctx, ctx.received, mu), over the trained parameters
            loss = loss + 0.5 * mu * torch.stack([((params[n] - anchor[n]) ** 2).sum() for n in names]).sum()
        new_buffers = {k: state[k] for k in buffers}
        return loss, (loss.detach(), new_buffers)

    def step(
        *inputs: Any,
        logit_map: tuple[Tensor | None, Tensor | None] | None = None,
        reads: dict[str, Tensor] | None = None,
        head_draws: Tensor | None = None,
    ) -> Any:
        """``inputs``: (params, buffers, anchor, x, y), each mapped over its first axis; ``logit_map`` as the
        stacked step's; ``reads``: the clients' rows of the received entries ``client_term`` reads; ``head_draws``:
        the step's draws of the clients' heads."""
        scale, shift = logit_map if logit_map is not None else (None, None)
        dims = (0,) * len(inputs) + tuple(None if v is None else 0 for v in (scale, shift, reads, head_draws))
        return vmap(grad(client_loss, has_aux=True), in_dims=dims)(*inputs, scale, shift, reads, head_draws)

    return step
