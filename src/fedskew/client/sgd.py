"""The local loop's arithmetic outside the model: :class:`LocalSGD` (``torch.optim.SGD``'s step, bit for bit, with
its per-call choices made once) and :func:`mean_step_loss` (the reported training loss, summed as a running float64
sum would)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.optim.sgd import sgd


class LocalSGD:
    """``torch.optim.SGD``'s step, bit for bit, at a fraction of its per-step cost.

    ``torch.optim.SGD.step`` re-derives per call what is fixed for a phase (its parameter groups, the state lookups,
    whether the tensors' device takes the multi-tensor path); at batch 10 on a CPU that costs about 2% of a training
    step. This calls the same update, ``torch.optim.sgd.sgd`` (SGD's functional form, which ``SGD.step`` calls), with
    the path chosen once as ``SGD`` chooses it, the same momentum-buffer bookkeeping, and parameters without a
    gradient skipped as ``SGD`` skips them. ``tests/test_local_sgd.py`` checks equality with ``torch.optim.SGD``.
    """

    def __init__(self, params: Sequence[Tensor], lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: list[Tensor | None] = [None] * len(self.params)
        self.foreach = _default_foreach(self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return
        params = [self.params[i] for i in live]
        grads = [p.grad for p in params]
        buffers = [self.buffers[i] for i in live]
        sgd(
            params,
            grads,  # type: ignore[arg-type]
            buffers,
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            lr=self.lr,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            has_sparse_grad=any(g.is_sparse for g in grads),  # type: ignore[union-attr]
            foreach=self.foreach,  # fused stays unset: SGD's default, as torch.optim.SGD leaves it
        )
        if self.momentum != 0:
            for i, buf in zip(live, buffers, strict=True):
                self.buffers[i] = buf


def _default_foreach(params: list[Tensor]) -> bool | None:
    """The multi-tensor choice ``torch.optim.SGD`` makes per step for these tensors, made once (``None``: leave it
    to torch per call, where this torch lacks the helper)."""
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach
    except ImportError:  # pragma: no cover - a torch without the (private) helper decides per call
        return None
    return _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1]


def mean_step_loss(losses: Sequence[Tensor], sizes: Sequence[int]) -> float:
    """The sample-weighted mean of the step losses: each ``loss·size`` in the losses' precision, summed in float64 in
    step order (exactly what a running float64 sum updated after every step gives); 0 without steps."""
    if not losses:
        return 0.0
    stacked = torch.stack(list(losses))
    weighted = (stacked * torch.tensor(list(sizes), dtype=stacked.dtype, device=stacked.device)).tolist()
    total = 0.0
    for v in weighted:
        total += v
    return total / sum(sizes)
