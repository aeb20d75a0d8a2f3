"""What the batched path needs of a method beyond its client part's own batched form, and the stacked forms of the
gradient rules that several client parts share.

Each client part declares its per-step hooks on stacked clients itself (``LocalAlgorithm.batched_step``,
:mod:`fedskew.client.batched_form`); :func:`batchable` says why a method (on a model) cannot be trained batched, and
:func:`pull_rows` / :func:`clip_rows` are the pull and the gradient-norm clip of a form's ``pull`` and ``clip`` on
stacked rows. The engine imports no concrete client part: adding one to the batched path means declaring its form
beside its hooks and an equivalence case in tests/test_batched_clients.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep, Envelope, InnerStep, split_batch
from fedskew.client.local import batched_form, unwrapped
from fedskew.engine.stacked import stackable
from fedskew.engine.step_functions import runs_under_vmap

if TYPE_CHECKING:
    from fedskew.methods import Method


_RANDOM_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


class Flat:
    """The trainable parameters of K clients as one ``[K, D]`` tensor, and named views into any rows of it."""

    def __init__(self, names: list[str], shapes: list[torch.Size]) -> None:
        self.names = names
        self.shapes = shapes
        self.sizes = [math.prod(s) for s in shapes]

    def stack(self, rows: Sequence[Sequence[Tensor]]) -> Tensor:
        """``rows[k]`` (one tensor per name) flattened and stacked: ``[K, D]``. A row given more than once (the same
        tensors: clients sent the same model) is flattened once."""
        keys = [tuple(id(t) for t in row) for row in rows]  # the rows hold their tensors for the call: ids stay theirs
        flat: dict[tuple[int, ...], Tensor] = {}
        for key, row in zip(keys, rows, strict=True):
            if key not in flat:
                flat[key] = torch.cat([t.reshape(-1) for t in row])
        return torch.stack([flat[key] for key in keys])

    def views(self, flat: Tensor) -> dict[str, Tensor]:
        parts = flat.split(self.sizes, dim=-1)
        return {n: p.view((*flat.shape[:-1], *s)) for n, p, s in zip(self.names, parts, self.shapes, strict=True)}

    def rows(self, flat: Tensor) -> list[dict[str, Tensor]]:
        """``[views(flat[k]) for k in range(K)]`` for ``flat`` ``[K, D]`` (the same views), in a split and a view and
        an unbind per name whatever ``K``, instead of a split and a view per name and row."""
        k = flat.shape[0]
        parts = [p.view(k, *s).unbind(0) for p, s in zip(flat.split(self.sizes, dim=-1), self.shapes, strict=True)]
        return (
            [dict(zip(self.names, row, strict=True)) for row in zip(*parts, strict=True)]
            if parts
            else [{} for _ in range(k)]
        )


def batchable(method: Method, model: nn.Module | None = None, precision: str = "float32") -> str | None:
    """Why ``method`` (on ``model``, when given) cannot be trained with batched clients; ``None`` when it can.

    Batched: every client part that declares its batched form (:func:`fedskew.client.local.batched_form`:
    each built-in one), with its uploads (FedCAC's masks) and any server plug-in (disco, heal, fedsa, fedper, fedbn,
    local, ...), since those change only what each client receives or how the server aggregates, and wrapped in
    wrappers that add work per client only (the loss before or after training that AFL, q-FFL and FedFV read).
    Refused, with the reason: a client part without a form (a user's own that overrides a training hook), a loss term
    on a model without a stacked form, a model with random layers (dropout) or a cumulative-average BatchNorm
    (``momentum=None``), and under ``precision`` bf16 a step that runs as ``vmap(grad(loss))`` through a LayerNorm or
    BatchNorm (torch's backward of either under vmap fails on autocast's mixed dtypes: measured on torch 2.13)."""
    form = batched_form(method.client)
    if isinstance(form, str):
        return form
    if model is not None:
        for name, module in model.named_modules():
            if isinstance(module, _RANDOM_LAYERS):
                return f"the model has a random layer ({name}: {type(module).__name__}); batched draws would differ"
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None:
                return f"the model's BatchNorm {name} uses a cumulative average (momentum=None)"
        if not (hasattr(model, "body") and hasattr(model, "head")):
            return "the model has no body/head split"
        if form.has_term:
            why = stackable(model.body) or stackable(model.head)
            if why is not None:
                name = type(unwrapped(method.client)).__name__
                return f"{name}'s loss term is batched for standard-layer models only ({why})"
        if precision != "float32":
            return _vmap_precision_refusal(form, model, precision)
    return None


_VMAP_AUTOCAST_FAILS = (nn.LayerNorm, nn.modules.batchnorm._BatchNorm)


def _vmap_precision_refusal(form: BatchedStep, model: nn.Module, precision: str) -> str | None:
    """Why the step of ``form`` on ``model`` cannot run under ``precision``'s autocast, or ``None``: only the
    ``vmap`` step (a client term without a stacked form, a model with layers the stacked graph lacks)
    through a layer whose backward fails there."""
    if not runs_under_vmap(model, form.client_term is not None and not form.client_term_stacked):
        return None  # the stacked graph, which runs its norms itself
    for name, module in model.named_modules():
        if isinstance(module, _VMAP_AUTOCAST_FAILS):
            return (
                f"precision {precision}: its step runs as vmap(grad(loss)), and torch's backward of {name} "
                f"({type(module).__name__}) under vmap fails on autocast's mixed dtypes"
            )
    return None


def pull_rows(
    grads: list[Tensor], params: list[Tensor], alpha: Tensor, anchors: Any, linear: Any | None
) -> list[Tensor]:
    """``client.drift.add_pull`` on stacked rows: ``g + α_k·(θ − anchor) − linear`` per parameter tensor."""
    out = []
    lin = list(linear) if linear is not None else [None] * len(grads)
    for g, p, a, li in zip(grads, params, list(anchors), lin, strict=True):
        scale = alpha.view(-1, *([1] * (g.dim() - 1)))
        g = g + scale * (p - a)
        out.append(g if li is None else g - li)
    return out


def clip_rows(grads: list[Tensor], clip: float) -> list[Tensor]:
    """``torch.nn.utils.clip_grad_norm_(params, clip)`` per client row: each client's gradients scaled by
    ``min(1, clip / (‖g‖ + 1e-6))``, ``‖g‖`` the 2-norm over all its parameter tensors."""
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads], dim=1)
    coef = (clip / (torch.linalg.vector_norm(norms, dim=1) + 1e-6)).clamp(max=1.0)
    return [g * coef.view(-1, *([1] * (g.dim() - 1))) for g in grads]


def sam_ascent(grads: list[Tensor], rho: float) -> list[Tensor]:
    """SAM's ascent per client row (``fedsam.sam_gradient``): ``ε = ρ·g/(‖g‖ + 1e-12)``, ``‖g‖`` the 2-norm of the
    per-tensor 2-norms of the client's gradients."""
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads], dim=1)
    scale = rho / (torch.linalg.vector_norm(norms, dim=1) + 1e-12)
    return [g * scale.view(-1, *([1] * (g.dim() - 1))) for g in grads]


def blend_rows(grads: list[Tensor], share: float, direction: Any | None) -> list[Tensor]:
    """A :class:`~fedskew.client.batched_form.Blend` on stacked rows: ``share·g + (1 − share)·direction`` per
    parameter tensor (``direction``: the clients' rows of each tensor, or ``None``: ``share·g``)."""
    scaled = [g * share for g in grads]
    if direction is None:
        return scaled
    return [g.add(d, alpha=1.0 - share) for g, d in zip(scaled, list(direction), strict=True)]


class StepRows(NamedTuple):
    """One step's stacked rows: the trained tensors (``params``, ``[R, ...]``), the other entries of the state dicts
    (``fixed``), the buffers, and the step's batches ``x``/``y`` (``[R, B, ...]``)."""

    params: dict[str, Tensor]
    fixed: dict[str, Tensor]
    buffers: dict[str, Tensor]
    x: Tensor
    y: Tensor


def hessian_free(
    d: dict[str, Tensor], plus: dict[str, Tensor], minus: dict[str, Tensor], lr: float, delta: float
) -> dict[str, Tensor]:
    """Per-FedAvg's Hessian-free correction of the direction ``d``: minus ``lr·[∇f(w + δd) − ∇f(w − δd)]/(2δ)``, the
    central difference of the gradients ``plus`` and ``minus`` (both paths, bucketed and padded)."""
    return {n: d[n] - lr * (plus[n] - minus[n]) / (2 * delta) for n in d}


def envelope_step(theta: Tensor, grad: Tensor, w: Tensor, lam: float, lr: float, mu: float) -> Tensor:
    """One of pFedMe's inner steps on ``f(θ) + (lam/2)‖θ − w‖² + (mu/2)‖θ‖²``: ``θ − lr·(∇f + lam·(θ − w) + mu·θ)``
    (both paths: per tensor in buckets, on the flat rows at padded shapes)."""
    return theta - lr * (grad + lam * (theta - w) + mu * theta)


def inner_gradient(
    step: Callable[..., Any], rows: StepRows, names: list[str], inner: InnerStep, lr: float
) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor]]:
    """An :class:`~fedskew.client.batched_form.InnerStep`'s direction on stacked rows: the direction per trained
    tensor, the reported loss ``[R]`` and the buffers after the whole batch's forward (the only pass that moves
    them)."""
    params, fixed, buffers, x, y = rows
    cuts = split_batch(y.shape[1], inner.parts)
    a = lr if inner.lr is None else inner.lr
    first = torch.zeros(y.shape[:2], dtype=params[names[0]].dtype, device=y.device)
    first[:, cuts[0]] = 1.0
    # the first slice's loss on the whole batch's forward (its batch statistics, as the loss hook's logits have)
    g1, (_, new_buffers, *_) = step({**params, **fixed}, buffers, {}, x, y, padding=(first, first.sum(1)))
    adapted = {n: params[n] - a * g1[n] for n in names}
    u, (loss, *_) = step({**fixed, **adapted}, new_buffers, {}, x[:, cuts[1]], y[:, cuts[1]])
    d = {n: u[n] for n in names}
    if inner.hessian_free:  # minus a·[∇f(w + δu) − ∇f(w − δu)]/(2δ) on the third slice
        x3, y3 = x[:, cuts[2]], y[:, cuts[2]]
        gp, _ = step({**fixed, **{n: params[n] + inner.delta * d[n] for n in names}}, new_buffers, {}, x3, y3)
        gm, _ = step({**fixed, **{n: params[n] - inner.delta * d[n] for n in names}}, new_buffers, {}, x3, y3)
        d = hessian_free(d, gp, gm, a, inner.delta)
    return d, loss, new_buffers


def envelope_gradient(
    step: Callable[..., Any], rows: StepRows, env: Envelope, theta: dict[str, Tensor]
) -> tuple[dict[str, Tensor], Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """An :class:`~fedskew.client.batched_form.Envelope`'s step on stacked rows: ``theta`` (``[R, ...]`` per trained
    tensor) after its inner steps on the batch, the model's gradient ``lam·(w − θ)``, ``θ``'s last loss ``[R]`` and
    the buffers after the whole batch's forward at ``w`` (the loop's forward, which moves them once a step)."""
    params, fixed, buffers, x, y = rows
    new_buffers = buffers
    if buffers:  # the loop runs the model on the batch before the loss hook: its BatchNorm statistics move
        _, (_, new_buffers, *_) = step({**params, **fixed}, buffers, {}, x, y)
    loss = torch.zeros(y.shape[0], device=y.device)
    for _ in range(env.steps):
        g, (loss, *_) = step({**fixed, **theta}, new_buffers, {}, x, y)
        theta = {n: envelope_step(t, g[n], params[n], env.lam, env.lr, env.mu) for n, t in theta.items()}
    return {n: env.lam * (params[n] - t) for n, t in theta.items()}, loss, new_buffers, theta


def padded_cuts(count: Tensor, b: int, parts: int, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
    """:func:`~fedskew.client.batched_form.split_batch` of each row's real samples in a padded batch (``count``
    ``[w]``, batch width ``b``), as masks: per slice, ``(0/1 weights [w, b], counts [w] at least 1)``. Each row's
    slices are those of its own batch of ``count`` samples (a slice past its end reuses its first); a row without a
    batch has empty slices."""
    size = (count + parts - 1) // parts  # ⌈n/parts⌉ per row
    j = torch.arange(b, device=count.device).unsqueeze(0)
    cuts = []
    for i in range(parts):
        lo = (i * size).unsqueeze(1)
        inside = (j >= lo) & (j < torch.minimum(lo + size.unsqueeze(1), count.unsqueeze(1)))
        mask = torch.where(lo < count.unsqueeze(1), inside, j < size.unsqueeze(1)).to(dtype)
        cuts.append((mask, mask.sum(1).clamp(min=1)))
    return cuts


def padded_inner_gradient(
    step: Callable[..., Any],
    state: dict[str, Tensor],
    names: list[str],
    x: Tensor,
    y: Tensor,
    count: Tensor,
    inner: InnerStep,
    real: Tensor | None = None,
    buffers: Sequence[str] = (),
) -> tuple[dict[str, Tensor], Tensor]:
    """:func:`inner_gradient` on a padded batch (``count`` real samples per row, engine/captured.py): each slice a
    mask over the whole padded batch rather than a narrower one, so that every pass keeps the step's shape.
    ``inner.lr`` is the inner step's, resolved. BatchNorm (``buffers``: its statistics among ``state``'s entries,
    ``real``: the batch's real samples) as the bucketed passes have it: the first pass's batch statistics over the
    whole batch's real samples, moving the running ones in ``state``; each later pass's over its own slice, on copies
    of the statistics, which it does not move. The direction per trained tensor and the reported loss ``[w]`` (0 on a
    row without a batch, whose direction is 0)."""
    cuts = padded_cuts(count, y.shape[1], inner.parts, state[names[0]].dtype)
    a = float(inner.lr) if inner.lr is not None else 0.0

    def at(shift: dict[str, Tensor]) -> dict[str, Tensor]:  # the state at other parameters, its statistics copied
        return {**state, **{n: state[n].clone() for n in buffers}, **shift}

    g1, _ = step(state, {}, {}, x, y, padding=cuts[0], real=real)
    u, (loss, *_) = step(at({n: state[n] - a * g1[n] for n in names}), {}, {}, x, y, padding=cuts[1], real=cuts[1][0])
    d = {n: u[n] for n in names}
    if inner.hessian_free:  # minus a·[∇f(w + δu) − ∇f(w − δu)]/(2δ) on the third slice
        third = {"padding": cuts[2], "real": cuts[2][0]}
        gp, _ = step(at({n: state[n] + inner.delta * d[n] for n in names}), {}, {}, x, y, **third)
        gm, _ = step(at({n: state[n] - inner.delta * d[n] for n in names}), {}, {}, x, y, **third)
        d = hessian_free(d, gp, gm, a, inner.delta)
    return d, loss


def padded_envelope_gradient(
    step: Callable[..., Any],
    state: dict[str, Tensor],
    flat: Flat,
    x: Tensor,
    y: Tensor,
    padding: tuple[Tensor, Tensor],
    env: tuple[float, int, float, float],
    theta: Tensor,
    live: Tensor,
    buffers: Sequence[str] = (),
) -> tuple[dict[str, Tensor], Tensor]:
    """:func:`envelope_gradient` on a padded batch: ``theta`` ``[w, D]`` (the rows of θ, updated in place, a row
    without a batch (``live`` 0) kept exactly, since the pull towards ``w`` would move it), ``env`` the envelope's
    ``(lam, steps, lr, mu)``. BatchNorm (``buffers``: its statistics among ``state``'s entries): the loop's forward at
    ``w`` moves them once a step, each of θ's passes runs on copies; every batch statistic is over the real samples.
    The model's gradient ``lam·(w − θ)`` per trained tensor and θ's last loss ``[w]``."""
    lam, steps, lr, mu = env
    p = torch.cat([state[n].reshape(theta.shape[0], -1) for n in flat.names], dim=1)
    th = theta.clone()
    loss = torch.zeros(theta.shape[0], device=theta.device)
    real = padding[0]
    if buffers:  # the loop runs the model on the batch before the loss hook: its BatchNorm statistics move
        step(state, {}, {}, x, y, padding=padding, real=real)
    for _ in range(steps):
        copies = {n: state[n].clone() for n in buffers}
        g, (loss, *_) = step({**state, **copies, **flat.views(th)}, {}, {}, x, y, padding=padding, real=real)
        with torch.no_grad():
            g_cat = torch.cat([g[n].reshape(th.shape[0], -1) for n in flat.names], dim=1)
            th = envelope_step(th, g_cat, p, lam, lr, mu)
    with torch.no_grad():
        theta.copy_(torch.where(live > 0, th, theta))
        return flat.views(lam * (p - theta)), loss
