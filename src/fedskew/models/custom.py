"""Bring your own model: any ``nn.Module`` as fedskew's ``body`` + ``head``.

fedskew's one training loop calls ``model.body(x)`` for the features and ``model.head(features)`` for the logits
(MOON contrasts the features, FedPer/FedRep keep ``head.*`` local, FedProto averages features per class), so a user's
model needs that split. :func:`split_model` makes it:

* a module that already has ``body`` and ``head`` sub-modules is used as it is;
* ``split_model(module, body=..., head=...)`` declares the split explicitly (``forward`` is then ``head(body(x))``);
* otherwise the split is inferred: the head is the module's **last** ``nn.Linear`` (in registration order), the body
  is a copy of the module with that layer replaced by ``nn.Identity``. The inference is checked on an example batch:
  the original module's output must equal ``head(body(x))``, i.e. the last Linear must be the last operation of the
  forward pass (no softmax or other layer after it). When it is not, or the module has no ``nn.Linear``, the error
  says why and how to declare the split.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from fedskew.models import FedModel, add_projection


class SplitError(ValueError):
    """The body/head split of a user model cannot be inferred or does not reproduce the model."""


def _last_linear(module: nn.Module) -> str | None:
    names = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and n]
    return names[-1] if names else None


def _replace(module: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    setattr(parent, child, new)


def split_model(
    module: nn.Module,
    *,
    body: nn.Module | None = None,
    head: nn.Module | None = None,
    example: Tensor | None = None,
) -> nn.Module:
    """``module`` as a model with ``body`` and ``head`` (module docstring). ``example``: an input batch to check an
    inferred split on (without it the inferred split is returned unchecked; fedskew's runner always passes one)."""
    if body is not None or head is not None:
        if body is None or head is None:
            raise SplitError("declare both body= and head= (or neither, to infer the split)")
        return FedModel(body, head)
    if isinstance(getattr(module, "body", None), nn.Module) and isinstance(getattr(module, "head", None), nn.Module):
        return module
    name = _last_linear(module)
    if name is None:
        raise SplitError(
            f"cannot infer the body/head split of {type(module).__name__}: it has no nn.Linear layer to use as the "
            "classifier head; pass split_model(module, body=..., head=...) or give the module .body and .head"
        )
    head_layer = copy.deepcopy(module.get_submodule(name))
    trunk = copy.deepcopy(module)
    _replace(trunk, name, nn.Identity())
    model = FedModel(trunk, head_layer)
    if example is not None:
        check_split(module, model, example, f"the last nn.Linear ({name!r})")
    return model


def check_split(original: nn.Module, model: nn.Module, example: Tensor, what: str = "the declared split") -> None:
    """Raise :class:`SplitError` unless ``model.head(model.body(x))`` equals ``original(x)`` on ``example``."""
    was = original.training, model.training
    original.eval()
    model.eval()
    try:
        with torch.no_grad():
            want = original(example)
            feats = model.body(example)
            if feats.dim() != 2:
                raise SplitError(
                    f"{type(original).__name__}: the body must output [batch, features], got shape "
                    f"{tuple(feats.shape)}; flatten before the head"
                )
            got = model.head(feats)
    except SplitError:
        raise
    except Exception as exc:  # a forward that breaks when the head is cut out
        raise SplitError(
            f"cannot split {type(original).__name__} at {what}: the forward pass failed without it ({exc}); "
            "pass split_model(module, body=..., head=...)"
        ) from exc
    finally:
        original.train(was[0])
        model.train(was[1])
    if want.shape != got.shape or not torch.allclose(want, got, rtol=1e-5, atol=1e-6):
        raise SplitError(
            f"cannot split {type(original).__name__} at {what}: head(body(x)) does not reproduce the model's output "
            "(is something applied after that layer, e.g. a softmax?); the model must output logits with the "
            "classifier last, or pass split_model(module, body=..., head=...)"
        )


def prepare_user_model(
    user_model: nn.Module | Callable[[], nn.Module], example: Tensor, options: Mapping[str, Any]
) -> nn.Module:
    """The run's model from a user's module (deep-copied) or factory (called here: the caller seeds it), split
    (:func:`split_model`, checked on ``example``), with MOON's projection head or a method's composite head when
    ``options`` asks for one."""
    if isinstance(user_model, nn.Module):
        module = copy.deepcopy(user_model)
    elif callable(user_model):
        module = user_model()
        if not isinstance(module, nn.Module):
            raise SplitError(f"the model factory returned {type(module).__name__}, not an nn.Module")
    else:
        raise SplitError(f"model must be an nn.Module or a function returning one, got {type(user_model).__name__}")
    model = split_model(module, example=example)
    if model is module:  # declared .body/.head: check them too
        check_split(module, FedModel(module.body, module.head), example, "its .body and .head")
    unknown = set(options) - {"projection", "head_module"}
    if unknown:
        raise SplitError(f"model options {sorted(unknown)} are not supported for user models")
    width = int(options.get("projection", 0))
    if width:
        if not isinstance(model.head, nn.Linear):
            raise SplitError(f"MOON's projection head needs an nn.Linear head, got {type(model.head).__name__}")
        body = model.body if isinstance(model.body, nn.Sequential) else nn.Sequential(model.body)
        model = add_projection(FedModel(body, model.head), width)
    head_module = options.get("head_module")
    if head_module is not None:
        if not isinstance(model.head, nn.Linear):
            raise SplitError(
                f"this method's composite head is made from an nn.Linear head, got {type(model.head).__name__}"
            )
        model.head = head_module(model.head)
    return model
