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

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import Tensor

from fedskew.client.batched_form import BatchedStep, FrozenTermFn, PaddedTerm, Padding, padded_mean
from fedskew.client.local import LocalAlgorithm, LocalContext, Wrapper


class LossTerm:
    """An additive term of the local objective. ``active``: whether it adds anything (a weight of 0 adds nothing,
    and the host's loss is then bit for bit its own)."""

    active: bool = True

    def __call__(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        """The term on one client's batch (a scalar)."""
        raise NotImplementedError

    def batched(self) -> FrozenTermFn | PaddedTerm | None:
        """The term on stacked clients: ``(features [K, B, D], logits [K, B, C], labels [K, B], frozen outputs)`` →
        ``[K]``, or a :class:`~fedskew.client.batched_form.PaddedTerm` that also reads which samples of a padded batch
        are real (then the composition runs at captured shapes too); ``None``: it has no stacked form (a run then
        trains the composition sequentially, saying why). Return the same object for the same hyper-parameters (a
        module-level ``functools.cache``), so that every round replays the same captured graphs."""
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
        if inner.inner is not None or inner.envelope is not None:  # Per-FedAvg's, pFedMe's surrogate losses
            return (
                f"its host's step is a direction through inner steps, which the batched form computes on the "
                f"cross-entropy alone; the added {type(self.term).__name__} is trained by the sequential loop"
            )
        host, padded = inner.term, isinstance(added, PaddedTerm)
        if host is None:
            return replace(inner, term=lambda ctx: added, term_per_sample=False, term_padded=padded)
        form = "sample" if inner.term_per_sample else "padded" if inner.term_padded else "client"

        def term(ctx: LocalContext) -> FrozenTermFn | None:
            first = host(ctx)
            return added if first is None else summed_term(first, form, added)

        # at captured shapes both parts must cover the real samples only: the host's per sample or padded
        return replace(inner, term=term, term_per_sample=False, term_padded=padded and form != "client")


@functools.lru_cache(maxsize=16)
def summed_term(first: FrozenTermFn, form: str, added: FrozenTermFn) -> PaddedTerm:
    """The host's term ``first`` (``form``: ``"sample"``, ``[K, B]``; ``"padded"``, a :class:`PaddedTerm`;
    ``"client"``, ``[K]``) plus an added term (a :class:`PaddedTerm` or ``[K]``), as one :class:`PaddedTerm`: each
    client's value, a per-sample part averaged over the real samples. The same parts give the same function (a
    host's term built once per hyper-parameters then replays the same captured graphs every round)."""

    def value(part: FrozenTermFn, part_form: str, *args: object, padding: Padding) -> Tensor:
        if isinstance(part, PaddedTerm):
            return part(*args, padding)  # type: ignore[arg-type]
        out = part(*args)  # type: ignore[arg-type]
        return padded_mean(out, padding) if part_form == "sample" else out

    def fn(
        feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]], padding: Padding
    ) -> Tensor:
        args = (feats, logits, y, outs)
        return value(first, form, *args, padding=padding) + value(added, "client", *args, padding=padding)

    return PaddedTerm(fn)


def with_term(term: LossTerm) -> Callable[[LocalAlgorithm], LocalAlgorithm]:
    """A plug-in's ``wrap_client``: the client part, whatever it is, plus ``term``."""
    return lambda algo: WithTerm(algo, term)
