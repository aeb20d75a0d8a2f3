"""The server-side seams of a federated round.

Everything a server method needs arrives as a :class:`RoundInput`: the K participants' uploads stacked along a
leading client axis (``params[name]`` has shape ``[K, *shape]``), their sample counts, any extra tensors they
uploaded, and the model that was broadcast. A server method is a :class:`ServerStrategy`; the common case is an
:class:`Aggregation`, the composition

    masks   = masking(round_input, state)            # optional: which client values enter each element (FedHEAL)
    weights = weighting(round_input, masks, state)    # one weight per client (size, uniform, Disco, FAEL)
    params  = combine(round_input, weights, masks)    # how stacked values become one (weighted mean, FedSA)

Each piece is a small object whose state is explicit: ``init(ctx) -> state`` and ``__call__(..., state) ->
(result, new_state)``. Stateless pieces return ``None`` as their state. Personalized methods (FedCAC, FedAMP)
implement :class:`ServerStrategy` directly and return one model per client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

Params = dict[str, Tensor]
State = Any


class UpdateError(ValueError):
    """A client upload that the server refuses (NaN/Inf, wrong shape or dtype, unknown tensor)."""


class NonFiniteUpdateError(UpdateError):
    """An upload holding NaN or Inf. In a simulation, where fedskew trained the client itself, this is divergence."""


@dataclass(frozen=True)
class ClientUpdate:
    """What one client uploads after local training."""

    cid: int
    params: Params
    num_samples: int
    extras: Params = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerContext:
    """What the server knows before the first round."""

    num_clients: int
    num_classes: int
    template: Params  # the initial global state dict (names, shapes, dtypes)
    trainable: frozenset[str]  # names of trainable parameters; the other state-dict entries are buffers
    num_train: np.ndarray  # [N] training samples per client
    label_hists: np.ndarray  # [N, num_classes] training label histogram per client


@dataclass(frozen=True)
class RoundInput:
    """One round's uploads, stacked along a leading client axis."""

    round: int
    cids: tuple[int, ...]
    params: Params  # name -> [K, *shape]
    num_samples: Tensor  # [K] float64
    extras: Params  # name -> [K, ...]
    global_params: Params  # the model broadcast at the start of the round
    trainable: frozenset[str]
    label_hists: np.ndarray  # [K, num_classes] participants' histograms

    @property
    def num_participants(self) -> int:
        return len(self.cids)

    def updates(self) -> Params:
        """Per-client model updates ``w_k - w_global`` (float tensors only)."""
        return {
            name: stacked - self.global_params[name].unsqueeze(0)
            for name, stacked in self.params.items()
            if stacked.is_floating_point()
        }


@dataclass(frozen=True)
class ServerOutput:
    global_params: Params
    personal: dict[int, Params] | None = None  # per-client models, for personalized methods
    diagnostics: dict[str, Any] = field(default_factory=dict)


class ServerStrategy(Protocol):
    """Anything that turns a round's uploads into the next model(s)."""

    def init(self, ctx: ServerContext) -> State: ...

    def aggregate(self, rin: RoundInput, state: State) -> tuple[ServerOutput, State]: ...


class Weighting(Protocol):
    def init(self, ctx: ServerContext) -> State: ...

    def __call__(self, rin: RoundInput, masks: Params | None, state: State) -> tuple[Tensor, State]:
        """Return ``[K]`` float64 non-negative weights summing to 1."""
        ...


class Masking(Protocol):
    def init(self, ctx: ServerContext) -> State: ...

    def __call__(self, rin: RoundInput, state: State) -> tuple[Params, State]:
        """Return name -> ``[K, *shape]`` bool masks (True: the client's value enters that element)."""
        ...


class Combine(Protocol):
    def __call__(self, rin: RoundInput, weights: Tensor, masks: Params | None) -> tuple[Params, dict[str, Any]]:
        """Return the new global state dict and diagnostics."""
        ...


@dataclass(frozen=True)
class Aggregation:
    """masks -> weights -> combine: the server step of FedAvg, +Disco, +HEAL and FedSA."""

    weighting: Weighting
    combine: Combine
    masking: Masking | None = None

    def init(self, ctx: ServerContext) -> State:
        return {
            "weighting": self.weighting.init(ctx),
            "masking": self.masking.init(ctx) if self.masking is not None else None,
        }

    def aggregate(self, rin: RoundInput, state: State) -> tuple[ServerOutput, State]:
        masks, mstate = (None, None)
        if self.masking is not None:
            masks, mstate = self.masking(rin, state["masking"])
        weights, wstate = self.weighting(rin, masks, state["weighting"])
        params, diagnostics = self.combine(rin, weights, masks)
        diagnostics = {"weights": weights.tolist(), **diagnostics}
        return ServerOutput(params, None, diagnostics), {"weighting": wstate, "masking": mstate}


def stack_updates(
    updates: Sequence[ClientUpdate],
    *,
    rnd: int,
    global_params: Params,
    trainable: frozenset[str],
    label_hists: np.ndarray,
) -> RoundInput:
    """Validate the uploads against the broadcast model and stack them along a client axis.

    Raises :class:`UpdateError` naming the client and tensor for a missing, extra, mis-shaped or non-finite upload.
    """
    if not updates:
        raise UpdateError("no client uploaded in this round")
    names = list(global_params)
    for u in updates:
        missing = [n for n in names if n not in u.params]
        extra = [n for n in u.params if n not in global_params]
        if missing or extra:
            raise UpdateError(f"client {u.cid}: upload has missing tensors {missing} / unknown tensors {extra}")
        for n in names:
            t, ref = u.params[n], global_params[n]
            if t.shape != ref.shape:
                raise UpdateError(
                    f"client {u.cid}: tensor '{n}' has shape {tuple(t.shape)}, expected {tuple(ref.shape)}"
                )
            if t.dtype != ref.dtype:
                raise UpdateError(f"client {u.cid}: tensor '{n}' has dtype {t.dtype}, expected {ref.dtype}")
        if u.num_samples <= 0:
            raise UpdateError(f"client {u.cid}: num_samples must be positive, got {u.num_samples}")
    extra_names = sorted(updates[0].extras)
    for u in updates:
        if sorted(u.extras) != extra_names:
            raise UpdateError(f"client {u.cid}: extras {sorted(u.extras)} differ from {extra_names}")
    params = {n: torch.stack([u.params[n] for u in updates]) for n in names}
    extras = {n: torch.stack([u.extras[n] for u in updates]) for n in extra_names}
    for kind, stacked in (("tensor", params), ("extra tensor", extras)):
        for n, t in stacked.items():  # one finiteness check per stacked tensor; find the client only on failure
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad = torch.isfinite(t).flatten(1).all(1).logical_not().nonzero().flatten().tolist()
                raise NonFiniteUpdateError(f"client {updates[bad[0]].cid}: {kind} '{n}' contains NaN or Inf")
    return RoundInput(
        round=rnd,
        cids=tuple(u.cid for u in updates),
        params=params,
        num_samples=torch.tensor([float(u.num_samples) for u in updates], dtype=torch.float64),
        extras=extras,
        global_params=global_params,
        trainable=trainable,
        label_hists=np.asarray(label_hists),
    )


def check_model(params: Params, template: Params, what: str) -> list[str]:
    """Check a model the server produced against the template: same names, shapes and dtypes, else ``TypeError``
    naming the tensor (a server-side bug, never to be run with). Returns the names of tensors holding NaN or Inf,
    which the engine reports as divergence."""
    if set(params) != set(template):
        missing, extra = sorted(set(template) - set(params)), sorted(set(params) - set(template))
        raise TypeError(f"{what}: missing tensors {missing} / unknown tensors {extra}")
    bad = []
    for n, ref in template.items():
        t = params[n]
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise TypeError(
                f"{what}: tensor '{n}' is {t.dtype}{list(t.shape)}, expected {ref.dtype}{list(ref.shape)}"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad.append(n)
    return bad
