"""K clients' forward passes as one ordinary autograd graph over stacked parameters (no ``vmap``).

:mod:`fedskew.engine.batched` trains a round's clients together. Its general step is ``vmap(grad(loss))`` over
``functional_call`` of the model, which works for any model but pays the functorch transforms' dispatch on every
operation of every step: on a GPU the small CNNs of the papers' tables then spend most of a step in the CPU, not in
the device. For models built from the layers below (every ``Sequential`` model of fedskew's zoo: ``mlp``, ``cnn``,
``lenet``, ``lenet_bn``) this module writes the same computation directly on stacked tensors, the way ``vmap``'s
own batching rules do, so that one step is one forward and one backward of plain PyTorch:

* ``Linear``: ``x [K, B, in] @ W[K]ᵀ + b[K]`` (``baddbmm``);
* ``Conv2d``: the K clients' channels side by side, ``[B, K·C, H, W]``, convolved with ``groups = K·groups``
  (each client's filters see only its own channels); or, with ``conv="unfold"``, each client's patches unfolded
  (im2col) and multiplied by its filters in one batched matmul; or, with ``conv="per_client"``, one ordinary
  convolution per client (:data:`CONV_FORMS`; which is faster depends on the device and the layer:
  ``benchmarks/conv_forms.py``; a run may name one form per layer, :func:`layer_forms`);
* ``BatchNorm1d/2d`` (training): the same channel layout, so every client's statistics are over its own batch, and
  its running statistics and ``num_batches_tracked`` are updated in its own rows;
* ``LayerNorm``: per sample, then each client's own affine map; ``Embedding``: each client's rows of its own table;
* ``ReLU``, ``MaxPool2d``, ``AvgPool2d``, ``Flatten``, ``Identity``: per sample, on ``[K·B, ...]``;
* a module that gives its own stacked form (``stacked_forward``, :func:`own_form`: GPFL's and FedCP's composite
  heads), written with its children's stacked forms (:class:`StackedCall`).

The clients' losses are independent, so the gradient of their sum with respect to client k's row is client k's own
gradient (the step itself, with what a client part's batched form adds to it: :mod:`fedskew.engine.stacked_step`).
Anything else (a residual block, a custom ``forward`` without a stacked form) makes :func:`stackable` say why, and the
caller uses ``vmap``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_PER_SAMPLE = (nn.ReLU, nn.MaxPool2d, nn.AvgPool2d, nn.Identity)


def own_form(module: nn.Module) -> bool:
    """Whether ``module`` gives its own stacked form: a method ``stacked_forward(s, x, *inputs, **kwargs)`` with
    ``s`` a :class:`StackedCall` (a composite head: GPFL's, FedCP's), run by :func:`stacked_forward` in place of its
    ``forward``. Its buffers are inputs of the form, which does not write them."""
    return callable(getattr(type(module), "stacked_forward", None))


def plain_linear(module: nn.Module) -> bool:
    """A ``Linear`` layer, or a subclass that keeps ``Linear``'s forward (a personal head with buffers of its own)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def stackable(module: nn.Module, prefix: str = "") -> str | None:
    """Why ``module`` cannot be run by :func:`stacked_forward`; ``None`` when it can."""
    name = prefix or type(module).__name__
    if type(module) is nn.Sequential or own_form(module):
        for child_name, child in module.named_children():
            why = stackable(child, f"{prefix}{child_name}.")
            if why is not None:
                return why
        return None
    if plain_linear(module) or type(module) in _PER_SAMPLE:
        return None
    if type(module) is nn.LayerNorm:
        return None
    if type(module) is nn.Embedding:
        plain = module.padding_idx is None and module.max_norm is None and not module.sparse
        return None if plain else f"{name}: Embedding with a padding index, a max norm or sparse gradients"
    if type(module) is nn.Flatten:
        return None if (module.start_dim, module.end_dim) == (1, -1) else f"{name}: Flatten other than (1, -1)"
    if type(module) is nn.Conv2d:
        if module.padding_mode != "zeros" or isinstance(module.padding, str):
            return f"{name}: Conv2d with padding {module.padding!r} / mode {module.padding_mode!r}"
        return None
    if type(module) in (nn.BatchNorm1d, nn.BatchNorm2d):
        return None if module.momentum is not None else f"{name}: BatchNorm with a cumulative average"
    return f"{name.rstrip('.')}: {type(module).__name__} has no stacked form"


def grouped_conv(m: nn.Conv2d, x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """K clients' convolutions as one grouped convolution: ``x [K, B, C, H, W]``, ``w [K, O, C/g, kh, kw]``, ``bias
    [K, O]`` → ``[K, B, O, H', W']``."""
    k, b = x.shape[0], x.shape[1]
    xs = x.transpose(0, 1).reshape(b, k * x.shape[2], *x.shape[3:])  # [B, K·C, H, W]
    flat_bias = None if bias is None else bias.reshape(-1)
    out = F.conv2d(
        xs, w.reshape(k * w.shape[1], *w.shape[2:]), flat_bias, m.stride, m.padding, m.dilation, m.groups * k
    )
    return out.view(b, k, -1, *out.shape[2:]).transpose(0, 1)


def grouped_conv_channels_last(m: nn.Conv2d, x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`grouped_conv` with its input and filters in channels-last memory order (what ``channels_last`` asks of a
    model's convolutions, kept by the stacked step): the same values up to float32 rounding, other kernels."""
    k, b = x.shape[0], x.shape[1]
    cl = torch.channels_last
    xs = x.transpose(0, 1).reshape(b, k * x.shape[2], *x.shape[3:]).contiguous(memory_format=cl)
    weight = w.reshape(k * w.shape[1], *w.shape[2:]).contiguous(memory_format=cl)
    flat_bias = None if bias is None else bias.reshape(-1)
    out = F.conv2d(xs, weight, flat_bias, m.stride, m.padding, m.dilation, m.groups * k)
    return out.view(b, k, -1, *out.shape[2:]).transpose(0, 1)


def unfold_conv(m: nn.Conv2d, x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """The same as :func:`grouped_conv` as im2col and one batched matmul: each client's ``[O/g, C/g·kh·kw]`` filters
    times its ``[C/g·kh·kw, B·L]`` patches, per group of its channels (``F.unfold`` orders a patch channel-major)."""
    k, b, c, h, wd = x.shape
    o, g = w.shape[1], m.groups
    cols = F.unfold(x.reshape(k * b, c, h, wd), m.kernel_size, m.dilation, m.padding, m.stride)  # [K·B, C·kh·kw, L]
    length = cols.shape[-1]
    cols = cols.view(k, b, g, -1, length).permute(0, 2, 3, 1, 4).reshape(k, g, -1, b * length)
    out = torch.matmul(w.reshape(k, g, o // g, -1), cols)  # [K, g, O/g, B·L]
    if bias is not None:
        out = out + bias.view(k, g, o // g, 1)
    ho = (h + 2 * m.padding[0] - m.dilation[0] * (m.kernel_size[0] - 1) - 1) // m.stride[0] + 1
    wo = (wd + 2 * m.padding[1] - m.dilation[1] * (m.kernel_size[1] - 1) - 1) // m.stride[1] + 1
    return out.view(k, o, b, ho, wo).transpose(1, 2)


def per_client_conv(m: nn.Conv2d, x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """The same as :func:`grouped_conv` as K ordinary convolutions, one per client (the sequential loop's kernels; on
    a GPU their K launches a step are what a captured step's graph replays without the host)."""
    outs = [
        F.conv2d(x[i], w[i], None if bias is None else bias[i], m.stride, m.padding, m.dilation, m.groups)
        for i in range(x.shape[0])
    ]
    return torch.stack(outs)


# the stacked convolution's forms (the run's ``stacked_conv``)
CONV_FORMS: dict[str, Callable[[nn.Conv2d, Tensor, Tensor, Tensor | None], Tensor]] = {
    "grouped": grouped_conv,
    "unfold": unfold_conv,
    "grouped_channels_last": grouped_conv_channels_last,  # "grouped" with the run's channels_last
    "per_client": per_client_conv,
}
# the forms a run may name (``grouped_channels_last`` is ``grouped`` under the run's ``channels_last``)
RUN_CONV_FORMS = ("grouped", "unfold", "per_client")

# the convolutions' forms of one step: one form for every Conv2d, or each Conv2d layer's own
ConvForms = str | Mapping[nn.Module, str]


def layer_forms(model: nn.Module, conv: str) -> ConvForms:
    """``conv`` (a run's ``stacked_conv``) for ``model``: one form of :data:`CONV_FORMS` for all its convolutions, or
    a comma-separated list of forms, one per Conv2d layer in the model's order (``per_client,grouped``: the first
    layer's convolutions one client at a time, the second's grouped), since the fastest form can differ by layer
    (``benchmarks/conv_forms.py`` times each layer alone). ``ValueError`` naming an unknown form, or a list whose
    length is not the model's number of convolutions."""
    names = [c.strip() for c in conv.split(",")]
    for name in names:
        if name not in CONV_FORMS:
            raise ValueError(f"stacked convolution {name!r}: expected one of {sorted(CONV_FORMS)}")
    if len(names) == 1:
        return names[0]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    if len(names) != len(convs):
        raise ValueError(
            f"stacked convolution {conv!r} names {len(names)} forms, one per layer, but the model has {len(convs)} "
            "Conv2d layers: give one form, or one per layer in the model's order"
        )
    return dict(zip(convs, names, strict=True))


def stacked_forward(
    module: nn.Module,
    state: dict[str, Tensor],
    x: Tensor,
    prefix: str = "",
    training: bool = True,
    conv: ConvForms = "grouped",
    real: Tensor | None = None,
    inputs: tuple[Tensor, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """``module``'s forward for K clients at once: ``x [K, B, ...]`` → ``[K, B, ...]``, with ``state[prefix + name]``
    the clients' stacked tensors (``[K, *shape]``). BatchNorm running statistics in ``state`` are updated in place
    in training mode (pass copies). ``conv``: the convolutions' form (:data:`CONV_FORMS`), or each Conv2d's
    (:func:`layer_forms`). ``real``: ``[K, B]`` 0/1, which samples of a padded batch are real
    (:mod:`fedskew.engine.captured`): BatchNorm's batch statistics are then each client's over its real samples only
    (:func:`masked_batch_norm`). ``inputs`` and ``kwargs``: further arguments of a module with its own stacked form
    (:func:`own_form`)."""
    kind = type(module)
    if own_form(module):
        call = StackedCall(module, state, prefix, training, conv, real)
        return module.stacked_forward(call, x, *inputs, **(kwargs or {}))  # type: ignore[operator]
    if inputs or kwargs:  # a head's draws given to a head that would not read them: refused, not dropped
        given = [*(f"input {i + 2}" for i in range(len(inputs))), *(kwargs or {})]
        raise ValueError(
            f"{prefix.rstrip('.') or kind.__name__} ({kind.__name__}) has no stacked form of its own, so it takes x "
            f"alone on the stacked graph, but was given {', '.join(given)}"
        )
    if kind is nn.Sequential:
        for child_name, child in module.named_children():
            x = stacked_forward(child, state, x, f"{prefix}{child_name}.", training, conv, real)
        return x
    k, b = x.shape[0], x.shape[1]
    if kind is nn.LayerNorm:  # per sample over its last dims, then each client's own affine map
        ln: nn.LayerNorm = module  # type: ignore[assignment]
        shape = tuple(ln.normalized_shape)
        out = F.layer_norm(x, shape, None, None, ln.eps)
        view = (k, *(1,) * (x.dim() - 1 - len(shape)), *shape)
        weight, bias = state.get(prefix + "weight"), state.get(prefix + "bias")
        if weight is not None:
            out = out * weight.view(view)
        if bias is not None:
            out = out + bias.view(view)
        return out
    if kind is nn.Embedding:  # each client's rows of its own table: x [K, ...] indices -> [K, ..., d]
        table = state[prefix + "weight"]  # [K, N, d]
        rows = torch.arange(k, device=x.device).view(k, *(1,) * (x.dim() - 1))
        return table[rows, x]
    if plain_linear(module):
        w = state[prefix + "weight"]  # [K, out, in]
        bias = state.get(prefix + "bias")
        xs = x.reshape(k, -1, x.shape[-1])  # [K, B·..., in]
        out = (
            torch.bmm(xs, w.transpose(1, 2))
            if bias is None
            else torch.baddbmm(bias.unsqueeze(1), xs, w.transpose(1, 2))
        )
        return out.view(*x.shape[:-1], w.shape[1])
    if kind is nn.Conv2d:
        form = CONV_FORMS[conv if isinstance(conv, str) else conv[module]]
        return form(module, x, state[prefix + "weight"], state.get(prefix + "bias"))  # type: ignore[arg-type]
    if kind in (nn.BatchNorm1d, nn.BatchNorm2d):
        bn: nn.modules.batchnorm._BatchNorm = module  # type: ignore[assignment]
        c = x.shape[2]
        xs = x.transpose(0, 1).reshape(b, k * c, *x.shape[3:])
        rm, rv = state.get(prefix + "running_mean"), state.get(prefix + "running_var")
        use_batch = training or rm is None
        if use_batch and real is not None:
            return masked_batch_norm(bn, state, prefix, x, real, training)
        if training and bn.track_running_stats and prefix + "num_batches_tracked" in state:
            state[prefix + "num_batches_tracked"].add_(1)
        weight, bias = state.get(prefix + "weight"), state.get(prefix + "bias")
        out = F.batch_norm(
            xs,
            None if rm is None else rm.view(-1),
            None if rv is None else rv.view(-1),
            None if weight is None else weight.reshape(-1),
            None if bias is None else bias.reshape(-1),
            use_batch,
            bn.momentum if bn.momentum is not None else 0.0,
            bn.eps,
        )
        return out.view(b, k, c, *out.shape[2:]).transpose(0, 1)
    if kind is nn.Flatten:
        return x.flatten(2)
    # per-sample layers: on [K·B, ...]
    out = module(x.reshape(k * b, *x.shape[2:]))
    return out.view(k, b, *out.shape[1:])


class StackedCall:
    """What a module's own stacked form (``stacked_forward(s, x, *inputs, **kwargs)``, :func:`own_form`) reads:
    ``s[name]``, the clients' stacked rows ``[K, ...]`` of its own entry ``name`` (a parameter or a buffer);
    ``s(child, x, *inputs, **kwargs)``, the stacked forward of its child module ``child`` (by attribute name) on
    the same state; ``s.training``, whether the step trains."""

    def __init__(
        self,
        module: nn.Module,
        state: dict[str, Tensor],
        prefix: str,
        training: bool,
        conv: ConvForms,
        real: Tensor | None,
    ) -> None:
        self.module, self.state, self.prefix = module, state, prefix
        self.training, self.conv, self.real = training, conv, real

    def __getitem__(self, name: str) -> Tensor:
        return self.state[self.prefix + name]

    def __call__(self, child: str, x: Tensor, *inputs: Tensor, **kwargs: Any) -> Tensor:
        module = getattr(self.module, child)
        prefix = f"{self.prefix}{child}."
        return stacked_forward(module, self.state, x, prefix, self.training, self.conv, self.real, inputs, kwargs)


class StackedRun:
    """The stacked forward of any of the model's modules by its dotted path, on a step's state: ``run("head.valve", z,
    c)``; ``state=``: other rows by full names (a frozen copy of the received body: pass copies of its buffers, which
    a training forward moves), ``training=``: the mode (default: training). The step's convolution forms and real
    samples apply. What a client term's stacked form calls (:class:`~fedskew.client.batched_form.ClientTerm`)."""

    def __init__(self, model: nn.Module, state: dict[str, Tensor], conv: ConvForms, real: Tensor | None) -> None:
        self.model, self.state, self.conv, self.real = model, state, conv, real

    def __call__(
        self,
        path: str,
        x: Tensor,
        *inputs: Tensor,
        state: dict[str, Tensor] | None = None,
        training: bool = True,
        **kwargs: Any,
    ) -> Tensor:
        module = self.model.get_submodule(path)
        rows = self.state if state is None else state
        return stacked_forward(module, rows, x, f"{path}.", training, self.conv, self.real, inputs, kwargs)


def masked_batch_norm(
    bn: nn.modules.batchnorm._BatchNorm, state: dict[str, Tensor], prefix: str, x: Tensor, real: Tensor, training: bool
) -> Tensor:
    """BatchNorm of padded batches (``x`` ``[K, B, C, ...]``, ``real`` ``[K, B]`` 0/1): each client's mean and
    (biased) variance per channel over its real samples only, a padding sample selected out. In training mode the
    running statistics in ``state`` move as ``F.batch_norm`` moves them (the unbiased variance), in place, for the
    clients with a real sample only, and so does ``num_batches_tracked``: a client whose batch is all padding (one
    that has finished) keeps its statistics exactly."""
    k, c = x.shape[0], x.shape[2]
    dims = (1, *range(3, x.dim()))  # the batch and the spatial positions
    tail = (1,) * (x.dim() - 3)
    keep = real.view(k, -1, 1, *tail) > 0
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    n = real.to(x.dtype).sum(1) * (x[0, 0, 0].numel())  # [K]: real values per channel
    mean = torch.where(keep, x, zero).sum(dims) / n.clamp(min=1).unsqueeze(1)  # [K, C]
    centred = torch.where(keep, x - mean.view(k, 1, c, *tail), zero)
    var = centred.pow(2).sum(dims) / n.clamp(min=1).unsqueeze(1)
    out = (x - mean.view(k, 1, c, *tail)) * torch.rsqrt(var.view(k, 1, c, *tail) + bn.eps)
    weight, bias = state.get(prefix + "weight"), state.get(prefix + "bias")
    if weight is not None:
        out = out * weight.view(k, 1, c, *tail)
    if bias is not None:
        out = out + bias.view(k, 1, c, *tail)
    rm, rv = state.get(prefix + "running_mean"), state.get(prefix + "running_var")
    if training and rm is not None and rv is not None:
        with torch.no_grad():
            m, live = float(bn.momentum or 0.0), (n > 0).unsqueeze(1)
            unbiased = var * (n / (n - 1).clamp(min=1)).unsqueeze(1)
            rm.copy_(torch.where(live, (1 - m) * rm + m * mean, rm))
            rv.copy_(torch.where(live, (1 - m) * rv + m * unbiased, rv))
            tracked = state.get(prefix + "num_batches_tracked")
            if tracked is not None:
                tracked.add_((n > 0).to(tracked.dtype))
    return out
