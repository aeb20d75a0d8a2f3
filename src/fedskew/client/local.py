"""Client side: the one local-training loop, and the hooks through which local algorithms change it.

A local algorithm never copies the loop. It overrides hooks:

* ``begin``            after the received model is loaded (e.g. keep a frozen copy of the global weights),
* ``loss``             the local objective from logits and features (FedProx: a proximal term; MOON: a contrastive one),
* ``after_backward``   gradient changes before the optimizer step,
* ``after_step``       parameter changes right after the optimizer step (SCAFFOLD's control-variate shift, which
                       must bypass the optimizer's momentum),
* ``end``              extra tensors to upload with the model (SCAFFOLD's control delta),
* ``phases``           the stretches of local training: where each starts, which parameters it trains, for how many
                       epochs, and whether the result is kept on the client (FedRep: head, then body; Ditto: the
                       personal model, then the global one),
* ``personal_model``   the model the client keeps for itself, if it keeps one apart from what it uploads (Ditto),
* ``personalize``      the client's personalized model made from the model it holds and its state, when that model
                       is not one it keeps (FedRoD: its personal head added to the generic one; Per-FedAvg: one step
                       from the global model on a local batch),

* ``check_model``      refuse a model the algorithm cannot train (MOON: no projection head of its width),
* ``eval_views``       views it adds to the evaluation of the global model (FedProto: nearest-prototype accuracy),
                       from what the server broadcasts.

What a client keeps across rounds is its *client state* (``ctx.client_state``, which the engine's client-state store
holds and a checkpoint saves): each entry is a :class:`StateKey` the part that keeps it declares in ``state_keys``
(SCAFFOLD's ``c_i``, MOON's previous model, Ditto's own model), read with ``ctx.kept(KEY)`` and written with
``ctx.keep(KEY, value)``; an entry nobody declared is refused after training (:func:`check_state`).

What the server keeps for an algorithm across rounds (SCAFFOLD's global control variate) is its *server half*, a
:class:`fedskew.server.api.ServerHalf` the registry pairs with it; the two exchange tensors only, through the
broadcast and the upload's extras, under names defined in :mod:`fedskew.protocol`. Everything is seeded by the
engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.client.batched_form import BatchedStep
from fedskew.client.precision import autocast, check_precision
from fedskew.client.sgd import LocalSGD, mean_step_loss
from fedskew.protocol import STEPS, TRAIN_LOSS, ClientReport, Params, Upload

_P = TypeVar("_P")
_S = TypeVar("_S")


@dataclass(frozen=True)
class StateKey(Generic[_S]):
    """One entry of a client's persistent state: its key in the state (what the client-state store and a checkpoint
    hold), the type of its value (``StateKey[Params]``: a model's tensors) and what it is. The client part that keeps
    it declares it in :attr:`LocalAlgorithm.state_keys`."""

    name: str
    what: str = ""

    def get(self, state: dict[str, Any]) -> _S | None:
        """The entry's value in a client's ``state`` (``None``: not kept yet)."""
        return state.get(self.name)


# the entries the engine itself keeps in every client's state: the state-dict entries the client keeps for itself
# (method.local: FedPer's head, FedBN's norms), overlaid on every model it receives
LOCAL_PARAMS = "local_params"
ENGINE_STATE = frozenset({LOCAL_PARAMS})


@dataclass(frozen=True)
class TrainSettings:
    """The local optimizer's settings of a run, and the run's length (``rounds``: the number of federated rounds,
    which a local objective scheduled over the run reads, e.g. FedProc's curriculum; ``None``: unknown, as in a
    context built by hand)."""

    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    drop_last: bool = False
    rounds: int | None = None
    precision: str = "float32"  # the training passes' arithmetic (client/precision.py): float32 or bf16

    def __post_init__(self) -> None:
        check_precision(self.precision)

    def autocast(self, device: torch.device | str) -> AbstractContextManager[object]:
        """The context a training pass on ``device`` runs in under :attr:`precision` (client/precision.py)."""
        return autocast(device, self.precision)

    def batches(self, n: int) -> tuple[int, int]:
        """A local epoch's batch size and batch count over ``n`` samples: batches of ``min(batch_size, n)``, the
        last partial one kept, or dropped under ``drop_last`` (PyTorch's ``DataLoader(drop_last=True)``, which
        PFLlib's loaders use; a client smaller than one batch keeps its one batch)."""
        bs = min(self.batch_size, n)
        return bs, (n // bs if self.drop_last else -(-n // bs))


class _KeptState:
    """Reading a client's persistent state through its typed keys (``client_state`` is the context's)."""

    cid: int
    client_state: dict[str, Any]

    def kept(self, key: StateKey[_S]) -> _S | None:
        """What this client kept under ``key`` (``None``: nothing yet)."""
        return key.get(self.client_state)

    def held(self, key: StateKey[_S]) -> _S:
        """What this client holds under ``key``, which must be there (kept earlier this round or in an earlier one)."""
        value = key.get(self.client_state)
        if value is None:
            raise KeyError(f"client {self.cid} holds no {key.name!r} in its state ({key.what or 'no description'})")
        return value


@dataclass
class LocalContext(_KeptState):
    """Everything one client's local training can see; ``begin`` leaves what its other hooks read in ``prepared``."""

    cid: int
    round: int
    model: nn.Module
    received: Params
    client_state: dict[str, Any]  # persists across rounds for this client
    broadcast: Params  # extra tensors the server sent (e.g. SCAFFOLD's c)
    settings: TrainSettings
    steps: int = 0
    phase: str = "main"
    # set by local_train: the client's resident training tensors and its seeded generator (hooks that need a pass
    # over the local data, e.g. FedALA's weight learning or a loss before training, draw from this generator)
    x: Tensor | None = None
    y: Tensor | None = None
    generator: torch.Generator | None = None
    # set by local_train: the whole client part's loss hook, wrappers included (``fedsam+feddecorr``: FedSAM's
    # cross-entropy plus the added term), for a hook that evaluates the objective again (SAM's second pass)
    objective: Callable[[LocalContext, Tensor, Tensor, Tensor, Tensor], Tensor] | None = None
    # the client's validation split (``validation`` > 0), never trained on: e.g. AFL's loss after training
    x_val: Tensor | None = None
    y_val: Tensor | None = None
    # scalar metrics a hook reports with the upload (RoundInput.metrics on the server), e.g. {"loss_before": ...}
    metrics: dict[str, float] = field(default_factory=dict)
    # what the client part's ``begin`` prepared for its other hooks and its batched form this round: a typed value of
    # the part's own (SCAFFOLD's correction, MOON's frozen models), read back with :meth:`prep`
    prepared: Any = None

    def keep(self, key: StateKey[_S], value: _S) -> None:
        """Keep ``value`` under ``key`` in this client's state, for its next rounds."""
        self.client_state[key.name] = value

    def take(self, key: StateKey[_S]) -> _S | None:
        """Remove and return what this client kept under ``key`` (``None``: nothing): an entry that lives within one
        round's training only (FedBABU's body-trained model)."""
        return self.client_state.pop(key.name, None)

    def prep(self, kind: type[_P]) -> _P:
        """``prepared`` as the type the client part's ``begin`` stored (checked: a mix-up is an error, not a tuple
        unpacked wrongly)."""
        if not isinstance(self.prepared, kind):
            raise TypeError(
                f"client {self.cid}: expected the {kind.__name__} that begin() prepares, found "
                f"{type(self.prepared).__name__}"
            )
        return self.prepared


@dataclass
class PersonalContext(_KeptState):
    """What :meth:`LocalAlgorithm.personalize` sees: the model client ``cid`` holds (``base``: the one it would start
    its next round from, i.e. the global model with the entries it keeps; for the ``trained`` view, the one it has just
    trained), its state (read only), the run's local settings, its training tensors and a generator seeded by (run
    seed, client, round) for any draw. ``model`` is a scratch module of the run's architecture, the hook's to load."""

    cid: int
    round: int
    model: nn.Module
    base: Params
    client_state: dict[str, Any]
    settings: TrainSettings
    x: Tensor
    y: Tensor
    generator: torch.Generator


@dataclass(frozen=True)
class Phase:
    """One stretch of local training on the one loop.

    ``start``: weights loaded before the phase (``None``: continue from the current ones; the first phase continues
    from the received model). ``trains``: which trainable parameters get updated (a predicate on the state-dict name;
    ``None``: all); the others are frozen for the phase. ``keep``: store a snapshot of the model after the phase in
    the client's state under that key. ``lr``: the phase's learning rate (``None``: the run's). Each phase has its own
    optimizer (momentum restarts, as in FedRep's and Ditto's code).
    """

    epochs: int
    name: str = "main"
    start: Params | None = None
    trains: Callable[[str], bool] | None = None
    keep: StateKey[Params] | None = None
    lr: float | None = None


class UploadExtras(Protocol):
    """Extra tensors a client computes from the model it received and the model it trained (FedCAC's masks)."""

    def __call__(self, received: Params, trained: Params, trainable: frozenset[str]) -> Params: ...


class LocalAlgorithm:
    """Plain local SGD on cross-entropy (FedAvg's client). Subclasses override hooks."""

    reports: tuple[ClientReport, ...] = ()  # statistics every client sends once, before round 1 (FedGen's histogram)
    # the entries this part keeps in a client's state across rounds (a subclass's add to its bases': declared_state)
    state_keys: ClassVar[tuple[StateKey[Any], ...]] = ()
    # why this part has no batched form (what --batched-clients reports); set, the part trains one client at a time
    unbatched: ClassVar[str] = ""

    # client-side hooks
    def begin(self, ctx: LocalContext) -> None:
        return None

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        return F.cross_entropy(logits, y)

    def after_backward(self, ctx: LocalContext) -> None:
        return None

    def after_step(self, ctx: LocalContext) -> None:
        """Called after each ``optimizer.step()`` (before ``ctx.steps`` counts it), outside autograd."""
        return None

    def end(self, ctx: LocalContext) -> Params:
        return {}

    def phases(self, ctx: LocalContext) -> list[Phase]:
        return [Phase(ctx.settings.epochs)]

    def personal_model(self, client_state: dict[str, Any]) -> Params | None:
        """The model this client keeps for itself apart from its upload (``None``: it keeps none)."""
        return None

    def personalize(self, ctx: PersonalContext) -> Params | None:
        """The client's personalized model made from ``ctx.base`` and its state, for a part whose personalized model
        is not a state dict it keeps (:meth:`personal_model` gives those); ``None``: ``ctx.base`` is its model."""
        return None

    def batched_step(self) -> BatchedStep | None:
        """This part's per-step hooks on stacked clients (:mod:`fedskew.client.batched_form`), for the batched path;
        ``None``: it has none, and a run trains it sequentially. A subclass that overrides a training hook declares
        its own (plain SGD here: no term, no shift)."""
        return BatchedStep()

    # checks and evaluation
    def check_model(self, template: Params, trainable: frozenset[str]) -> None:
        """Raise when this algorithm cannot train a model with this state dict (``template``) and these trainable
        entries; called once, before round 1."""
        return None

    def eval_views(
        self, model: nn.Module, broadcast: Params, x: Tensor, y: Tensor, owner: Tensor, num_owners: int, batch_size: int
    ) -> dict[str, tuple[Tensor, Tensor]]:
        """Views this algorithm adds to the evaluation of the global model in ``model``, given what the server
        broadcasts: per view name, ``(correct, loss_sum)`` per owner (domain, or one for the whole test set)."""
        return {}


# every hook of LocalAlgorithm (a method it defines): what a wrapper forwards, whatever hooks are added later
HOOKS = tuple(n for n, v in vars(LocalAlgorithm).items() if callable(v) and not n.startswith("_"))


def _forward(hook: str) -> Any:
    def forward(self: Wrapper, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, hook)(*args, **kwargs)

    forward.__name__ = hook
    forward.forwarded = True  # type: ignore[attr-defined]
    return forward


class Wrapper(LocalAlgorithm):
    """A client part around another one (``inner``), adding work of its own: every hook of :class:`LocalAlgorithm`
    and every attribute goes to ``inner`` unless the wrapper's class defines it. The forwarding is built from
    :data:`HOOKS`, so a hook added to ``LocalAlgorithm`` later is forwarded too, and the training loop sees through
    the forwarders (:func:`overrides`): a hook ``inner`` does not use is never called."""

    inner: LocalAlgorithm

    @property
    def reports(self) -> tuple[ClientReport, ...]:  # type: ignore[override]
        return self.inner.reports

    def compose_batched(self, inner: BatchedStep) -> BatchedStep | None:
        """The batched form of this wrapper around a part whose form is ``inner``, for a wrapper that adds work to
        the per-step hooks (an added loss term: :class:`fedskew.client.terms.WithTerm`); ``None`` (the default): it
        adds none, and only per-client hooks may be its own."""
        return None

    def __getattr__(self, attr: str) -> Any:  # only called for attributes this wrapper does not have
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)


for _hook in HOOKS:
    setattr(Wrapper, _hook, _forward(_hook))


def declared_state(algo: LocalAlgorithm) -> frozenset[str]:
    """The names of the client-state entries ``algo`` keeps: the ``state_keys`` of every class of the part and of
    the parts its wrappers wrap."""
    names: set[str] = set()
    while True:
        names |= {k.name for c in type(algo).__mro__ for k in vars(c).get("state_keys", ())}
        if not isinstance(algo, Wrapper):
            return frozenset(names)
        algo = algo.inner


def check_state(algo: LocalAlgorithm, state: dict[str, Any]) -> None:
    """Refuse a client state holding an entry that no part declared: it would be saved and restored with no owner
    (and two parts writing one undeclared name would overwrite each other unseen)."""
    undeclared = set(state) - declared_state(algo) - ENGINE_STATE
    if undeclared:
        raise TypeError(
            f"client part {type(unwrapped(algo)).__name__} keeps {sorted(undeclared)} in the client state without "
            "declaring them: list each as a StateKey in its state_keys (fedskew.client.local.StateKey)"
        )


def overrides(algo: LocalAlgorithm, hook: str) -> bool:
    """Whether ``algo`` does anything in ``hook`` (a wrapper's forwarder counts as its inner part's hook)."""
    method = getattr(type(algo), hook)
    if getattr(method, "forwarded", False):
        return overrides(algo.inner, hook)  # type: ignore[attr-defined]
    return method is not getattr(LocalAlgorithm, hook)


# the hooks that change what a client trains; a subclass overriding one of them needs a batched form of its own
TRAINING_HOOKS = ("begin", "loss", "after_backward", "after_step", "end", "phases", "personal_model")
# the hooks a wrapper may add work to and still be batched: they run per client on a real context
PER_CLIENT_HOOKS = ("begin", "end", "check_model", "eval_views", "personalize")


def _own_hooks(cls: type, hooks: tuple[str, ...]) -> list[str]:
    return [h for h in hooks if h in vars(cls)]


def unwrapped(algo: LocalAlgorithm) -> LocalAlgorithm:
    """The client part whose local step runs: ``algo``, or the one its wrappers hand their hooks to."""
    while isinstance(algo, Wrapper):
        algo = algo.inner
    return algo


def batched_form(algo: LocalAlgorithm) -> BatchedStep | str:
    """The batched form ``algo`` trains with, or why it has none.

    Wrappers are seen through when they add work only to hooks that run per client (``begin``, ``end``: the loss
    before or after training that AFL, q-FFL and FedFV read). The form is the one the nearest class in the part's
    MRO declares (:meth:`LocalAlgorithm.batched_step`); a class below it that overrides a
    training hook, or a form of ``None``, means none."""
    while isinstance(algo, Wrapper):
        if type(algo).compose_batched is not Wrapper.compose_batched:  # it composes its own per-step work
            inner = batched_form(algo.inner)
            return inner if isinstance(inner, str) else algo.compose_batched(inner)  # type: ignore[return-value]
        wrappers = [c for c in type(algo).__mro__ if issubclass(c, Wrapper) and c is not Wrapper]
        own = {h for c in wrappers for h in _own_hooks(c, (*TRAINING_HOOKS, "batched_step"))}
        extra = sorted(own - set(PER_CLIENT_HOOKS))
        if extra:
            return f"its wrapper {type(algo).__name__} overrides {', '.join(extra)}, which run at every step"
        algo = algo.inner
    cls = type(algo)
    if algo.unbatched:  # the part says why it has none (pFedMe: K inner steps of a second model at every step)
        return f"its client part {cls.__name__} declares no batched form ({algo.unbatched})"
    declaring = next(c for c in cls.__mro__ if "batched_step" in vars(c))
    below = [c for c in cls.__mro__[: cls.__mro__.index(declaring)] if issubclass(c, LocalAlgorithm)]
    hooks = sorted({h for c in below for h in _own_hooks(c, TRAINING_HOOKS)})
    if hooks:
        return (
            f"its client part {cls.__name__} overrides {', '.join(hooks)} below {declaring.__name__}, whose batched "
            "form does not know them; declare batched_step() on it (docs/extending.md)"
        )
    form = algo.batched_step()
    if form is None:
        why = algo.unbatched or "batched_step() returns None"
        return f"its client part {cls.__name__} declares no batched form ({why})"
    return form


def snapshot(model: nn.Module) -> Params:
    """A detached copy of the model's full state dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def local_train(
    algo: LocalAlgorithm,
    ctx: LocalContext,
    x: Tensor,
    y: Tensor,
    generator: torch.Generator,
    upload_extras: Sequence[UploadExtras] = (),
    input_noise: float = 0.0,
    live: bool = False,
) -> Upload:
    """Load ``ctx.received`` into ``ctx.model``, train on the resident tensors ``x, y``, return the upload.

    Batches are index slices of a seeded permutation per epoch (no DataLoader); ``generator`` fixes the order.
    ``input_noise``: Gaussian noise of this std added to every batch as it is drawn (NIID-Bench's feature noise, a
    fresh draw at every access, from ``generator``).
    The algorithm's phases run in sequence on the same model; ``upload_extras`` add tensors computed from the
    received and the trained model (e.g. FedCAC's critical masks) to the algorithm's own extras. ``live``: the
    upload's ``params`` are the model's own tensors (detached, not copied), valid until the model trains or loads
    again: for a caller that copies them at once (the simulator's round server, into its upload stack) and clones
    what it keeps; otherwise a copy.
    """
    model, s = ctx.model, ctx.settings
    ctx.x, ctx.y, ctx.generator, ctx.objective = x, y, generator, algo.loss
    model.load_state_dict(ctx.received)
    model.train()
    algo.begin(ctx)
    n = x.shape[0]
    bs, n_batches = s.batches(n)
    losses: list[Tensor] = []  # the step losses, summed once after training (no tensor operation per step)
    sizes: list[int] = []
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    # hooks the algorithm does not override are not called in the hot loop
    after_backward = algo.after_backward if overrides(algo, "after_backward") else None
    after_step = algo.after_step if overrides(algo, "after_step") else None
    amp = s.autocast(x.device)  # the forward and loss of each step (float32: a context that does nothing)
    for phase in algo.phases(ctx):
        ctx.phase = phase.name
        if phase.start is not None:
            model.load_state_dict(phase.start)
        frozen = [p for name, p in named if phase.trains is not None and not phase.trains(name)]
        params = [p for name, p in named if phase.trains is None or phase.trains(name)]
        for p in frozen:
            p.requires_grad_(False)
        opt = LocalSGD(
            params, lr=s.lr if phase.lr is None else phase.lr, momentum=s.momentum, weight_decay=s.weight_decay
        )
        try:
            for _ in range(phase.epochs):
                perm = torch.randperm(n, generator=generator).to(x.device)
                for b in range(n_batches):
                    idx = perm[b * bs : (b + 1) * bs]
                    xb, yb = x[idx], y[idx]
                    if input_noise:
                        noise = torch.randn(xb.shape, generator=generator, device=generator.device)
                        xb = xb + input_noise * noise.to(xb.device)
                    opt.zero_grad()
                    with amp:
                        feats = model.body(xb)
                        logits = model.head(feats)
                        loss = algo.loss(ctx, logits, feats, yb, xb)
                    loss.backward()
                    if after_backward is not None:
                        after_backward(ctx)
                    opt.step()
                    if after_step is not None:
                        with torch.no_grad():
                            after_step(ctx)
                    ctx.steps += 1
                    losses.append(loss.detach())
                    sizes.append(yb.shape[0])
        finally:
            for p in frozen:
                p.requires_grad_(True)
        if phase.keep is not None:
            ctx.keep(phase.keep, snapshot(model))
    extras = algo.end(ctx)
    check_state(algo, ctx.client_state)
    trained = dict(model.state_dict()) if live else snapshot(model)  # state_dict(): detached, storage shared
    trainable = frozenset(name for name, _ in named)
    for up in upload_extras:
        extras = {**extras, **up(ctx.received, trained, trainable)}
    train_loss = mean_step_loss(losses, sizes)
    return Upload(
        cid=ctx.cid,
        params=trained,
        num_samples=n,
        extras=extras,
        metrics={**ctx.metrics, TRAIN_LOSS: train_loss, STEPS: float(ctx.steps)},
    )
