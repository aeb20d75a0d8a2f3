"""The stacked step: K clients' gradients, losses and buffers from one forward and one backward of plain PyTorch over
their stacked parameters, with the pieces a client part's batched form adds to it (a proximal term, a loss term
against frozen models or through the head, a client's own term, logit maps, a side head, a representation, a
mixture), written with the stacked layers of :mod:`fedskew.engine.stacked`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.client.batched_form import (
    FrozenTermFn,
    HeadTermFn,
    PaddedTerm,
    StackedTermFn,
    map_logits,
    padded_mean,
)
from fedskew.client.precision import autocast, check_precision
from fedskew.engine.stacked import StackedRun, layer_forms, stacked_forward

# the keys of a side head's gradients in a step's gradients (and of its rows among a batched phase's carried tensors)
SIDE_WEIGHT, SIDE_BIAS = "side:weight", "side:bias"
REPR_BIAS, REPR_RUNNING = "repr:bias", "repr:running"  # a representation's bias (its gradient, its rows) and its r
MIX_V, MIX_ALPHA = "mix:v", "mix:alpha"  # a mixture's second model (gradients: MIX_V + name) and its weight
ENV_THETA = "env:theta"  # an envelope's personalized model (its rows)


def stacked_step_function(
    model: nn.Module,
    names: list[str],
    mu: float,
    term: FrozenTermFn | None = None,
    head_term: HeadTermFn | None = None,
    conv: str = "grouped",
    precision: str = "float32",
    client_term: StackedTermFn | None = None,
    head_draw: str | None = None,
) -> Callable[..., tuple[dict[str, Tensor], tuple[Tensor, dict[str, Tensor]]]]:
    """The same contract as ``vmap(grad(client_loss, has_aux=True))`` in :mod:`fedskew.engine.batched`:
    ``step(params, buffers, anchor, x, y)`` with stacked ``[K, ...]`` tensors returns ``(grads, (loss, buffers,
    features))``: each client's gradient of its cross-entropy (+ FedProx's proximal term), its loss, its buffers after
    the forward pass and its body's output (detached; FedProto's prototypes are collected from it). ``params`` holds
    the trained parameters (``names``) and the frozen ones.

    ``term``: a loss term against frozen models on the same batch (MOON's model-contrastive term, FedNTD's not-true
    distillation), for which ``step`` takes ``rows = (models, mask)``: per model name the clients' full state dicts
    (run in eval mode, without gradient, as the client parts' frozen copies are) and a ``[K]`` 0/1 mask of the
    clients the term applies to (``None``: all; a masked client's loss is exactly the cross-entropy).

    ``head_term``: a loss term through the trained head on inputs drawn for the step (FedGen's generated features),
    for which ``step`` takes ``drawn``, the step's inputs (``None``: the term is off for the step).

    ``padding``: ``(weights [K, B], counts [K])`` for batches padded to one shape (:mod:`fedskew.engine.captured`): each
    client's cross-entropy is the sum of its samples' losses times their 0/1 weights over its count (at least 1), the
    mean over its real samples; ``None``: every sample is real. ``real``: ``[K, B]`` 0/1, the samples BatchNorm's batch
    statistics cover (the padded steps' real ones; ``None``: all, which is what an inner step's slices want: their
    loss on a slice, their statistics over the whole batch).

    ``logit_map``: ``(scale, shift)``, ``[K, C]`` each or ``None``, each client's map of its logits before the
    cross-entropy (:class:`~fedskew.client.batched_form.LogitMap`: FedLC, FedRS); a frozen-model term reads the
    unmapped logits. ``side``: ``(weight [K, C, d], bias [K, C])``, a head per client trained beside the model
    (:class:`~fedskew.client.batched_form.SideHead`): ``CE(logits.detach() + side(features.detach()), y)`` is added to
    each client's loss and its gradients are returned under :data:`SIDE_WEIGHT` and :data:`SIDE_BIAS`.
    ``represent``: ``(bias [K, d] or None, running [K, d], momentum, target [d] or None, weight)``, the pieces of a
    :class:`~fedskew.client.batched_form.Representation`: the bias is added to the body's output before the head
    (its gradient returned under :data:`REPR_BIAS`), and with a target the running mean of this batch's mean is
    pulled to it; the caller advances ``running`` from the returned features. ``mixture``: ``(v, alpha [K])``, a
    :class:`~fedskew.client.batched_form.Mixture`'s second model (per trained parameter, ``[K, ...]``) and weight: the
    cross-entropy of ``α·v + (1 − α)·w.detach()`` is added to each client's loss, the gradients returned under
    ``MIX_V + name`` and :data:`MIX_ALPHA`.

    ``client_term``: the stacked form of a :class:`~fedskew.client.batched_form.ClientTerm` (GPFL's global path,
    FedCP's MMD), added to each client's loss; ``step`` takes ``reads``, the clients' rows of the received entries it
    reads. ``head_draw``: the keyword of the head's forward a step's draws go to (FedCP's Gumbel noise), for which
    ``step`` takes ``head_draws`` ``[K, B, ...]``.

    ``precision``: ``bf16`` runs the forward passes and losses under bfloat16 autocast
    (:mod:`fedskew.client.precision`); the gradients, the loss and the features returned are float32."""
    body, head = model.body, model.head
    forms = layer_forms(model, conv)
    check_precision(precision)

    def fwd(
        module: nn.Module,
        state: dict[str, Tensor],
        x: Tensor,
        training: bool = True,
        real: Tensor | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> Tensor:
        return stacked_forward(module, state, x, training=training, conv=forms, real=real, kwargs=kwargs)

    def part(state: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
        return {n[len(prefix) :]: v for n, v in state.items() if n.startswith(prefix)}

    buffer_names = frozenset(n for n, _ in model.named_buffers())

    def moving(state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The model's buffers among ``state``'s entries (BatchNorm's statistics, which a training forward moves)."""
        return {n: v for n, v in state.items() if n in buffer_names}

    def step(
        params: dict[str, Tensor],
        buffers: dict[str, Tensor],
        anchor: dict[str, Tensor],
        x: Tensor,
        y: Tensor,
        rows: tuple[dict[str, dict[str, Tensor]], Tensor | None] | None = None,
        drawn: Any = None,
        padding: tuple[Tensor, Tensor] | None = None,
        logit_map: tuple[Tensor | None, Tensor | None] | None = None,
        side: tuple[Tensor, Tensor] | None = None,
        represent: tuple[Tensor | None, Tensor, float, Tensor | None, float] | None = None,
        mixture: tuple[dict[str, Tensor], Tensor] | None = None,
        real: Tensor | None = None,
        reads: dict[str, Tensor] | None = None,
        head_draws: Tensor | None = None,
    ) -> tuple[dict[str, Tensor], tuple[Tensor, dict[str, Tensor]]]:
        leaves = {n: params[n].detach().requires_grad_() for n in names}
        sides = [t.detach().requires_grad_() for t in side] if side is not None else []
        rep_bias = None
        if represent is not None and represent[0] is not None:
            rep_bias = represent[0].detach().requires_grad_()
            sides.append(rep_bias)
        mix_v = {n: t.detach().requires_grad_() for n, t in mixture[0].items()} if mixture is not None else {}
        mix_alpha = mixture[1].detach().requires_grad_() if mixture is not None else None
        new_buffers = {n: v.clone() for n, v in buffers.items()}
        state = {**params, **leaves, **new_buffers}
        amp = autocast(x.device, precision)
        with torch.enable_grad():
            with amp:  # the forward passes and losses in the run's precision (client/precision.py)
                feats = fwd(body, part(state, "body."), x, real=real)
                head_in = feats if rep_bias is None else feats + rep_bias.unsqueeze(1)  # FedDBE's PRBM
                drawn_kw = None if head_draw is None or head_draws is None else {head_draw: head_draws}
                logits = fwd(head, part(state, "head."), head_in, real=real, kwargs=drawn_kw)
                k, b = logits.shape[0], logits.shape[1]
                mapped = logits if logit_map is None else map_logits(logits, *logit_map)
                ce = F.cross_entropy(mapped.reshape(k * b, -1), y.reshape(k * b), reduction="none").view(k, b)
                if side is not None:  # a head trained beside the model on the detached logits and features (FedRoD's)
                    personal = torch.matmul(feats.detach(), sides[0].transpose(1, 2)) + sides[1].unsqueeze(1)
                    summed = logits.detach() + personal
                    ce = ce + F.cross_entropy(summed.reshape(k * b, -1), y.reshape(k * b), reduction="none").view(k, b)
                loss = padded_mean(ce, padding)
                if client_term is not None:  # GPFL's global path, FedCP's MMD
                    run = StackedRun(model, state, forms, real)
                    loss = loss + client_term(run, state, feats, y, x, reads or {}, padding)
                if mix_alpha is not None:  # APFL: CE of α·v + (1 − α)·w.detach(), run with w's buffers (copies)
                    a = mix_alpha
                    # (the buffers are copies wherever they come: apart, or among the rows at padded shapes)
                    mixed_state = {**params, **{k: v.clone() for k, v in {**moving(params), **buffers}.items()}}
                    for n, v in mix_v.items():
                        a_n = a.view(-1, *([1] * (v.dim() - 1)))
                        mixed_state[n] = a_n * v + (1 - a_n) * leaves[n].detach()
                    f2 = fwd(body, part(mixed_state, "body."), x, real=real)
                    personal_logits = fwd(head, part(mixed_state, "head."), f2, real=real)
                    ce2 = F.cross_entropy(personal_logits.reshape(k * b, -1), y.reshape(k * b), reduction="none")
                    loss = loss + padded_mean(ce2.view(k, b), padding)
                if represent is not None and represent[3] is not None:  # FedDBE's MR: weight·mean(½(r − target)²)
                    _, running, momentum, target, weight = represent
                    r = (1 - momentum) * running + momentum * padded_mean(feats, padding)
                    loss = loss + weight * (0.5 * (r - target) ** 2).mean(1)
                if mu != 0:
                    loss = loss + 0.5 * mu * torch.stack(
                        [((leaves[n] - anchor[n]) ** 2).flatten(1).sum(1) for n in names], dim=1
                    ).sum(1)
                if term is not None and rows is not None:
                    models, mask = rows
                    outs = {}
                    with torch.no_grad():
                        for name, frozen in models.items():
                            f = fwd(body, part(frozen, "body."), x, training=False)
                            outs[name] = (f, fwd(head, part(frozen, "head."), f, training=False))
                    if isinstance(term, PaddedTerm):  # a statistic of each batch over its real samples
                        extra = term(feats, logits, y, outs, padding)
                        if extra.shape != (k,):
                            shape = list(extra.shape)
                            raise ValueError(f"a PaddedTerm must give one value per client [{k}], got {shape}")
                    else:
                        extra = term(feats, logits, y, outs)
                        if padding is not None and extra.shape != (k, b):  # a per-client value averages the padding
                            raise ValueError(
                                f"a loss term at padded shapes must give one value per sample [{k}, {b}], got "
                                f"{list(extra.shape)} (BatchedStep.term_per_sample)"
                            )
                        if extra.dim() == 2:  # per sample: each client's mean over its real samples
                            extra = padded_mean(extra, padding)
                    loss = loss + (extra if mask is None else mask * extra)
                if head_term is not None and drawn is not None:
                    head_state = part(state, "head.")
                    loss = loss + head_term(lambda z: fwd(head, head_state, z), drawn)
            mixed_leaves = [*mix_v.values(), mix_alpha] if mix_alpha is not None else []
            grads = torch.autograd.grad(loss.sum(), [*(leaves[n] for n in names), *sides, *mixed_leaves])
        out = dict(zip(names, grads, strict=False))
        rest = list(grads[len(names) :])
        if side is not None:
            out[SIDE_WEIGHT], out[SIDE_BIAS] = rest.pop(0), rest.pop(0)
        if rep_bias is not None:
            out[REPR_BIAS] = rest.pop(0)
        if mix_alpha is not None:
            out.update({MIX_V + n: rest.pop(0) for n in mix_v})
            out[MIX_ALPHA] = rest.pop(0)
        loss, feats = loss.detach(), feats.detach()
        if precision != "float32":  # autocast's bfloat16 activations back to the parameters' float32
            loss, feats = loss.float(), feats.float()
        return out, (loss, new_buffers, feats)

    return step
