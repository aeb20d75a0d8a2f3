"""The client's loss on its own training data at the received model, before local training.

AFL, q-FFL and FedFV weigh or order the clients by this loss (fair_flearn's ``get_loss``, flgo's
``test(model, 'train')``, MarsFL's ``get_train_loss``: one evaluation pass over the local training set at the global
model). A server plug-in that needs it returns ``"wrap_client": with_loss_before`` from its build, and
:func:`fedskew.methods.resolve_method` wraps whatever client part the method has: ``fedprox+qffl``, ``moon+afl``,
``scaffold+afl``. The wrapper changes nothing of the host's training; it only adds, in ``begin`` (the received model
is loaded, training has not started), the metrics

* ``loss_before``: the sample-weighted mean cross-entropy over the client's training tensors, the model in eval mode
  (BatchNorm statistics untouched),
* ``lr``: the client's learning rate (q-FFL's Lipschitz estimate ``L = 1/lr``, computed on the clients in the
  reference code), and
* ``momentum``: the client's SGD momentum (with ``lr`` and the ``steps`` every client reports, q-FFL's default
  estimate ``L_k = (1 − β)²/(lr · τ_k²)``, :func:`fedskew.catalog.fairness.qffl_lipschitz`),

which reach the server as ``RoundInput.metrics['loss_before']`` / ``['lr']`` / ``['momentum']``. The pass is
deterministic (the whole training set, no sampling), so it draws nothing from the client's generator.

:class:`LossAfter` (``with_loss_after``) reports instead, in ``end`` (after the host's own ``end``, on the model it
uploads), ``loss_after``: the mean cross-entropy of the trained model on the client's **validation split**
(``validation`` > 0; :class:`~fedskew.client.local.LocalContext` ``x_val``/``y_val``). It is what FedHEAL's framework
(MarsFL's ``AFLSever``) feeds AFL, except that MarsFL scores the client's *test* split; fedskew never reads a test
split during training, so it uses the validation split carved from the client's training data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.client.local import LocalAlgorithm, LocalContext, Wrapper
from fedskew.protocol import Params

# the metrics the wrappers add to the upload (RoundInput.metrics on the server, [K] float64 each)
LOSS_BEFORE = "loss_before"  # the received model's mean loss on the training data (AFL, q-FFL, FedFV)
LOSS_AFTER = "loss_after"  # the trained model's mean loss on the client's validation split (AFL loss=after)
LEARNING_RATE = "lr"  # the client's local learning rate (q-FFL)
MOMENTUM = "momentum"  # the client's local SGD momentum (q-FFL)

EVAL_BATCH = 1024  # samples per forward pass of the loss computation (no effect on the value beyond float rounding)


@torch.no_grad()
def mean_loss(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = EVAL_BATCH) -> float:
    """Sample-weighted mean cross-entropy of ``model`` on ``(x, y)`` in eval mode (the mode is restored)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    try:
        for i in range(0, x.shape[0], batch_size):
            total += F.cross_entropy(model(x[i : i + batch_size]), y[i : i + batch_size], reduction="sum").double()
    finally:
        model.train(was_training)
    return float(total) / max(x.shape[0], 1)


@dataclass
class LossBefore(Wrapper):
    """``inner`` unchanged, plus the loss before training in ``ctx.metrics`` (module docstring). Every other hook and
    attribute is the inner algorithm's (``eval_views`` of a prototype host included), by construction
    (:class:`~fedskew.client.local.Wrapper`)."""

    inner: LocalAlgorithm

    def begin(self, ctx: LocalContext) -> None:
        assert ctx.x is not None and ctx.y is not None
        ctx.metrics[LOSS_BEFORE] = mean_loss(ctx.model, ctx.x, ctx.y)
        ctx.metrics[LEARNING_RATE] = float(ctx.settings.lr)
        ctx.metrics[MOMENTUM] = float(ctx.settings.momentum)
        self.inner.begin(ctx)


def with_loss_before(algo: LocalAlgorithm) -> LocalAlgorithm:
    """``algo`` reporting its loss before training (once: wrapping twice adds nothing)."""
    return algo if isinstance(algo, LossBefore) else LossBefore(algo)


@dataclass
class LossAfter(Wrapper):
    """``inner`` unchanged, plus ``loss_after`` (the trained model's loss on the validation split) in ``ctx.metrics``
    (module docstring). Needs the run's clients to have validation splits."""

    inner: LocalAlgorithm
    needs_validation = True

    def end(self, ctx: LocalContext) -> Params:
        extras = self.inner.end(ctx)
        if ctx.x_val is None or ctx.y_val is None or ctx.x_val.shape[0] == 0:
            raise ValueError(
                f"client {ctx.cid}: the loss after training is scored on the client's validation split, and it has "
                "none: set validation to a share of the training split (e.g. 0.1)"
            )
        ctx.metrics[LOSS_AFTER] = mean_loss(ctx.model, ctx.x_val, ctx.y_val)
        return extras


def with_loss_after(algo: LocalAlgorithm) -> LocalAlgorithm:
    """``algo`` reporting its trained model's loss on its validation split (once)."""
    return algo if isinstance(algo, LossAfter) else LossAfter(algo)
