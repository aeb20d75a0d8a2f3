"""User-level DP for the Flower-native strategies (:mod:`fedskew.flower.strategies`), with the simulator's mechanism.

The clip runs on the node, the noise on the server, as DP-FedAvg (McMahan et al., ICLR 2018) and fedskew's own
ServerApp/ClientApp do it (docs/privacy.md):

- **node**: :func:`dp_clip_mod` as a ClientApp mod (``ClientApp(mods=[dp_clip_mod(1.0)])``): the train reply's model
  update (trained minus received, every floating array as one flattened vector) is clipped to norm ``C`` by
  :func:`fedskew.privacy.mechanism.clip_update`, the simulator's function. The node's own training stays the user's.
- **server**: ``FedskewStrategy(..., dp=FlowerDP(clip=C, rounds=T, noise_multiplier=z))`` (or ``target_epsilon``:
  ``z`` calibrated for the ``T`` rounds) replaces the composition's weighted mean by
  :class:`~fedskew.privacy.server.PrivateMean`: capped weights, Gaussian noise ``N(0, (z C)^2)`` added once to the
  weighted sum, division by the fixed expected cohort weight, then the composition's server step; the ε spent is in
  every round's ``history[-1].diagnostics["epsilon"]`` and in :attr:`FedskewStrategy.privacy`.

Flower's sampling is the event's: ``fraction_train`` of the connected nodes drawn without replacement each round
(``max(int(N * fraction_train), min_train_nodes)`` of N), full participation when that is every node.

Unlike Flower's central-DP wrappers, the sensitivity accounts for the weights: a weight is a sensitivity multiplier,
so the weights are capped (at 1 in units of the cap) and their sum's denominator is fixed. Sample-count weights need
every client's count before the first round, which a Flower server does not have: the native strategies run DP with
uniform weights (``method_args={"weights": "uniform"}``) and refuse the others with the reason, as they refuse
compositions that cannot be private (masks, per-client models, FedDisco's reports: docs/privacy.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Context, Message, MessageType

from fedskew.flower.codec import from_record, to_record
from fedskew.methods import Method
from fedskew.privacy.accountant import Sampling
from fedskew.privacy.mechanism import clip_update
from fedskew.privacy.server import PrivacyPlan, PrivateMean, plan_privacy, private_server, refusal
from fedskew.protocol import ServerContext
from fedskew.schema import ConfigError


@dataclass(frozen=True)
class FlowerDP:
    """User-level DP settings of a Flower-native strategy: the clip norm ``C`` the nodes clip to (their
    :func:`dp_clip_mod` must use the same), the run's ``rounds`` (what ε is accounted and calibrated over), the noise
    multiplier ``z`` or a ``target_epsilon``, ``delta``, the accountant (``rdp`` or ``pld``) and the weight cap
    (default: the mean private weight)."""

    clip: float
    rounds: int
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    accountant: str = "rdp"
    weight_cap: float | None = None

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise ValueError(f"FlowerDP: clip must be positive, got {self.clip}")
        if self.rounds < 1:
            raise ValueError(f"FlowerDP: rounds must be >= 1, got {self.rounds}")
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("FlowerDP: give exactly one of noise_multiplier and target_epsilon")
        if self.accountant not in ("rdp", "pld"):
            raise ValueError(f"FlowerDP: accountant must be 'rdp' or 'pld', got {self.accountant!r}")


def check_private(method: Method) -> None:
    """Refuse, with the reason, a composition that cannot be private on a Flower-native strategy."""
    why = refusal(method)
    if why is not None:
        raise ValueError(f"{method.name!r} cannot run under differential privacy: {why}")
    if method.server_half.private:
        raise ValueError(f"{method.name!r}: its server half's extras are not carried by the Flower-native strategies")


def flower_sampling(n: int, fraction_train: float, min_train_nodes: int) -> Sampling:
    """The cohort event of Flower's FedAvg sampling over ``n`` connected nodes."""
    m = min(n, max(int(n * fraction_train), min_train_nodes))
    return Sampling("full", n) if m >= n else Sampling("fixed", n, m=m)


def private_mean(
    method: Method, dp: FlowerDP, ctx: ServerContext, sampling: Sampling
) -> tuple[PrivateMean, PrivacyPlan]:
    """The private server step for ``method`` and its plan; a weighting that needs the clients' counts is refused."""
    private = method.server.weighting.private(ctx, None)  # type: ignore[attr-defined]
    if not (np.asarray(private.values, dtype=np.float64) > 0).any():
        raise ValueError(
            f"{method.name!r} under DP weights clients by {private.kind}, which a Flower server does not know before "
            "the first round: use method_args={'weights': 'uniform'}"
        )
    try:
        plan = plan_privacy(
            method,
            ctx,
            clip=dp.clip,
            noise_multiplier=dp.noise_multiplier,
            target_epsilon=dp.target_epsilon,
            delta=dp.delta,
            accountant=dp.accountant,  # type: ignore[arg-type]
            sampling=sampling,
            rounds=dp.rounds,
            weight_cap=dp.weight_cap,
        )
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return private_server(method, plan, ctx, frozenset()), plan


def dp_clip_mod(clip: float, arrays_key: str = "arrays") -> Callable[[Message, Context, Any], Message]:
    """A ClientApp mod clipping each train reply's model update to norm ``clip`` (the strategy's
    ``FlowerDP.clip``): every floating array of the reply, relative to what the node received, as one vector."""
    if not clip > 0:
        raise ValueError(f"dp_clip_mod: clip must be positive, got {clip}")

    def mod(msg: Message, context: Context, call_next: Any) -> Message:
        reply = call_next(msg, context)
        if msg.metadata.message_type != MessageType.TRAIN or reply.has_error():
            return reply
        received = from_record(msg.content[arrays_key])
        name = arrays_key if arrays_key in reply.content.array_records else next(iter(reply.content.array_records))
        trained = from_record(reply.content[name])
        names = tuple(n for n, t in received.items() if t.is_floating_point() and n in trained)
        clipped, _, _ = clip_update(received, trained, names, clip)
        reply.content[name] = to_record(clipped)
        return reply

    return mod
