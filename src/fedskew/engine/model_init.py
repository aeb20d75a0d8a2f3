"""The run's model: which one ``auto`` stands for, building it (or the user's) from the run's init stream on the run's
device, and the state-dict entries a method keeps on the clients (:data:`LOCAL_GROUPS`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from fedskew.data.protocols import PROTOCOLS
from fedskew.models import TOKEN_MODELS, build_model, head_keys, norm_keys
from fedskew.schema import ConfigError
from fedskew.seeding import Purpose, global_rng, torch_seed

if TYPE_CHECKING:
    from fedskew.config import RunConfig
    from fedskew.data.pools import FederatedData
    from fedskew.methods import Method


def resolve_model_name(cfg: RunConfig, data: FederatedData, method: Method | None = None) -> str:
    """The model ``auto`` stands for: ``textcnn`` for token ids (text), ``cnn`` for images of at least 16 px, else
    ``mlp``; a method that keeps the normalization layers on the clients (FedBN) gets ``lenet_bn``, the smallest zoo
    model with BatchNorm."""
    if cfg.model != "auto":
        return cfg.model
    if data.holds_tokens:
        return "textcnn"
    if method is not None and "norm" in method.local:
        return "lenet_bn"
    return "cnn" if data.image_size >= 16 else "mlp"


UserModel = nn.Module | Callable[[], nn.Module]
TEXT_MODEL = "textcnn"  # the zoo's default model of token ids (TOKEN_MODELS: every one)


def user_model_name(model: UserModel) -> str:
    """How a user's model is recorded in config.yaml: ``custom:<class or function name>``."""
    name = type(model).__name__ if isinstance(model, nn.Module) else getattr(model, "__name__", type(model).__name__)
    return f"custom:{name}"


def init_model(
    cfg: RunConfig, data: FederatedData, method: Method | None = None, user_model: UserModel | None = None
) -> nn.Module:
    """Build the model with weights drawn from the run's init stream (global torch RNG left untouched).

    ``user_model``: a module of the user's (copied, its weights are the initial model) or a function returning one
    (called under the init stream, so the seed fixes its weights), split into body + head by
    :func:`fedskew.models.custom.split_model` (checked on a batch of client 0's data)."""
    if user_model is not None:
        from fedskew.models.custom import prepare_user_model

        with global_rng(torch_seed(cfg.seed, Purpose.INIT)):
            example = data.clients[0].x_train[:2].cpu()
            model = prepare_user_model(user_model, example, method.model_options if method is not None else {})
            with torch.no_grad():
                width = model.eval()(example).shape[-1]
            model.train()
        if width != data.num_classes:
            raise ConfigError(
                f"the model outputs {width} logits per sample but {data.name!r} has {data.num_classes} classes; "
                f"give its classifier {data.num_classes} outputs"
            )
        return _placed(model, cfg)
    if cfg.model.startswith("custom:"):
        raise ConfigError(
            f"model {cfg.model!r} was a user's model; pass it again: fedskew.run(..., model=...) (docs/extending.md)"
        )
    name = resolve_model_name(cfg, data, method)
    if (name in TOKEN_MODELS) != data.holds_tokens:
        raise ConfigError(
            f"dataset {data.name!r} holds token ids (text): use --model {TEXT_MODEL} (or auto)"
            if data.holds_tokens
            else f"model {name!r} reads token ids (a text dataset such as ag_news); dataset {data.name!r} holds "
            f"images or features: choose another model (or auto)"
        )
    with global_rng(torch_seed(cfg.seed, Purpose.INIT)):
        model = build_model(
            name,
            in_channels=data.in_channels,
            image_size=data.image_size,
            num_classes=data.num_classes,
            norm=cfg.norm,
            **(method.model_options if method is not None else {}),
        )
    return _placed(model, cfg)


def _placed(model: nn.Module, cfg: RunConfig) -> nn.Module:
    """The model on the run's device, its 4-D (convolution) weights channels-last when ``cfg.channels_last``: the
    layout is kept through ``load_state_dict`` (a copy into the existing tensors), so every client trains in it."""
    model = model.to(torch.device(cfg.device))
    return model.to(memory_format=torch.channels_last) if cfg.channels_last else model


LOCAL_GROUPS = {
    "buffers": "non-trainable entries (BatchNorm running statistics)",
    "head": "the classifier head (FedPer, FedRep)",
    "body": "every entry but the classifier head: the representation (LG-FedAvg)",
    "norm": "normalization layers: affine parameters and running statistics (FedBN)",
    "all": "every entry: no collaboration (Local / Separate)",
    "personal": "the entries a method's composite head marks personal, head.personal.* (FedCP, GPFL)",
}
PERSONAL_PREFIX = "head.personal."  # what a composite head (models.replace_head) keeps on each client


def local_state_names(groups: frozenset[str], model: nn.Module, trainable: frozenset[str]) -> frozenset[str]:
    """State-dict names behind the groups (:data:`LOCAL_GROUPS`) a method keeps on the clients."""
    template = model.state_dict()
    names: set[str] = set()
    for group in groups:
        if group == "buffers":
            names |= {n for n in template if n not in trainable}
        elif group == "head":
            names |= head_keys(model)
        elif group == "body":
            names |= set(template) - head_keys(model)
        elif group == "norm":
            found = norm_keys(model)
            if not found:
                raise ConfigError(
                    f"the model has no normalization layers, so keeping them local (FedBN) would be plain FedAvg; "
                    f"use a model with BatchNorm (e.g. --model resnet8), got layers {sorted(template)[:4]}..."
                )
            names |= found
        elif group == "all":
            names |= set(template)
        elif group == "personal":
            found = {n for n in template if n.startswith(PERSONAL_PREFIX)}
            if not found:
                raise ConfigError(
                    f"the model's head has no personal entries ({PERSONAL_PREFIX}*) to keep on the clients; build it "
                    "with the method's model options (its composite head)"
                )
            names |= found
        else:
            raise ConfigError(f"unknown client-local group {group!r}; known: {', '.join(LOCAL_GROUPS)}")
    return frozenset(names)


def kept_local(cfg: RunConfig, method: Method, model: nn.Module, trainable: frozenset[str]) -> frozenset[str]:
    """The state-dict entries a run's clients keep for themselves: the method's groups and its protocol's (PFLlib's
    clients keep their buffers)."""
    return local_state_names(frozenset(method.local | PROTOCOLS[cfg.protocol].local), model, trainable)
