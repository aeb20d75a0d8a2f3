"""An added loss term: a regularizer that composes with any client part, as its paper uses it on any host.

Some methods are not a client objective of their own but a term added to whatever the client optimizes (FedDecorr's
decorrelation penalty goes on FedAvg's, FedProx's, MOON's ... loss). Such a method is a server plug-in whose build
returns ``"wrap_client": with_term(MyTerm(...))``; :func:`fedskew.methods.resolve_method` wraps the composition's
client part, so ``fedprox+feddecorr`` trains ``FedProx.loss + term`` and ``feddecorr`` alone is FedAvg's plus the
term. The term declares both of its forms: :meth:`LossTerm.__call__` on one client's batch (the sequential loop) and
:meth:`LossTerm.batched` on stacked clients (the batched path), and :class:`WithTerm` composes the latter with the
host's own batched form, so the composition stays batched wherever the host is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import Tensor

from fedskew.client.batched_form import BatchedStep, FrozenTermFn
from fedskew.client.local import LocalAlgorithm, LocalContext, Wrapper


class LossTerm:
    """An additive term of the local objective. ``active``: whether it adds anything (a weight of 0 adds nothing,
    and the host's loss is then bit for bit its own)."""

    active: bool = True

    def __call__(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        """The term on one client's batch (a scalar)."""
        raise NotImplementedError

    def batched(self) -> FrozenTermFn | None:
        """The term on stacked clients: ``(features [K, B, D], logits [K, B, C], labels [K, B], frozen outputs)`` →
        ``[K]``; ``None``: it has no stacked form (a run then trains the composition sequentially, saying why)."""
        return None


@dataclass
class WithTerm(Wrapper):
    """``inner``'s objective plus ``term``; every other hook is ``inner``'s."""

    inner: LocalAlgorithm
    term: LossTerm

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        own = self.inner.loss(ctx, logits, features, y, x)
        return own + self.term(ctx, logits, features, y, x) if self.term.active else own

    def compose_batched(self, inner: BatchedStep) -> BatchedStep | str | None:  # type: ignore[override]
        if not self.term.active:
            return inner
        added = self.term.batched()
        if added is None:
            return f"its added term {type(self.term).__name__} has no batched form"
        if inner.previous is not None:  # the host's term is masked per client (MOON's first participation)
            return f"its host's loss term is masked per client, and the added {type(self.term).__name__} is not"
        host = inner.term

        def term(ctx: LocalContext) -> FrozenTermFn | None:
            first = host(ctx) if host is not None else None
            if first is None:
                return added
            return lambda feats, logits, y, outs: first(feats, logits, y, outs) + added(feats, logits, y, outs)

        return replace(inner, term=term)


def with_term(term: LossTerm) -> Callable[[LocalAlgorithm], LocalAlgorithm]:
    """A plug-in's ``wrap_client``: the client part, whatever it is, plus ``term``."""
    return lambda algo: WithTerm(algo, term)
