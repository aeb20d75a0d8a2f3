"""Batched clients: many clients' local training at once on one device, exactly as the sequential loop trains them.

The sequential path (:func:`fedskew.client.local.local_train`, one client after another on one reusable model) pays
the per-step overhead of a small batch once per client and step; on a GPU a step of one client at batch 10 leaves the
device almost idle. Here every client of the round gets a row of stacked parameters ``[K, D]`` and one step of all of
them is one call of ``vmap(grad(loss))`` over ``torch.func.functional_call`` of the one model, or, for models made
of standard layers (every ``Sequential`` model of the zoo), the same computation written on the stacked rows as one
plain autograd graph (:mod:`fedskew.engine.stacked`: no functorch dispatch per operation).

What makes it the sequential path's training, not an approximation of it:

* **the same batches**: client ``c`` draws its per-epoch permutations from its own generator
  ``torch_generator(seed, SHUFFLE, c, round)``, in epoch order, exactly the draws ``local_train`` makes, and its
  batches are the same slices of them (``bs = min(batch_size, n)``, ``drop_last`` as configured);
* **no padding**: at every step the clients still training are *bucketed by their current batch size* (full batches,
  a smaller last batch, a client with ``n < batch_size``); each bucket is its own vmapped call, so the cross-entropy
  mean and every BatchNorm statistic are computed over exactly the client's real samples, and a client that has
  finished its steps simply stops being in a bucket;
* **the same model function**: ``head(body(x))`` with the client's parameters and buffers; BatchNorm running
  statistics and ``num_batches_tracked`` update per client inside the call, as in the module's own forward;
* **the same optimizer**: ``torch.optim.SGD``'s update written on the stacked rows (weight decay added to the
  gradient, momentum buffer ``buf = g`` on the first step, then ``buf·β + g``, ``p −= lr·buf``);
* **the same hooks**: ``begin`` and ``end`` of the client part run per client on a real :class:`LocalContext`
  (SCAFFOLD's ``c_i`` and control deltas come from its own ``end``); only the per-step hooks are written batched, for
  the client parts listed in :data:`BATCHED_STEPS` (FedProx's proximal term, SCAFFOLD's shift after the step).

Anything else (other hooks, several phases, a personal model, per-client uploads, a randomized model) is refused by
:func:`batchable` with the reason, and the engine trains such a method sequentially.

Float rounding differs (a vmapped convolution or linear layer sums in another order than the module's kernel, about
1e-8 per gradient), so models usually agree to 1e-7 after a round (tests/test_batched_clients.py checks 1e-5). Local
SGD can amplify that rounding: where a pre-activation sits within rounding distance of a ReLU's zero, one ulp decides
the branch. The sequential loop started from its input moved by one ulp differs from itself by as much
(docs/_fragments/batched.md, ``benchmarks/batched_clients.py --noise-floor``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from fedskew.client.algorithms import FedProx, Moon, Scaffold
from fedskew.client.baselines import FedNTD, not_true_logits
from fedskew.client.drift import FedDC, FedDyn
from fedskew.client.local import LocalAlgorithm, LocalContext, TrainSettings
from fedskew.client.loss_before import LossBefore
from fedskew.engine.stacked import FrozenTermFn, stackable, stacked_step_function
from fedskew.protocol import ClientUpdate, Params
from fedskew.seeding import Purpose, torch_generator

if TYPE_CHECKING:  # annotations only: the simulation is seen through engine/host.py, never engine/loop.py
    from fedskew.engine.host import ClientHost, RoundHost
    from fedskew.engine.rounds import RoundResult
    from fedskew.methods import Method

HOOKS = ("begin", "loss", "after_backward", "after_step", "end", "phases", "personal_model")


@dataclass(frozen=True)
class BatchedStep:
    """How one client part's per-step hooks are computed on stacked clients.

    ``prox_mu``: the weight of FedProx's proximal term ``(mu/2)·Σ‖w − w_received‖²`` added to the cross-entropy
    (0: none). ``pull``: from the client's context after ``begin``, ``(α_k, anchor, linear)`` whose gradient
    ``α_k(θ − anchor) − linear`` is added to the loss's gradient after the backward pass (FedDyn, FedDC:
    ``client.drift.add_pull``; ``linear`` may be ``None``), and ``clip``: the client's total gradient-norm clip applied
    then (0: none; ``clip_grad_norm_``'s formula, per client). ``shift``: the tensors added to its trainable parameters
    after every optimizer step and their scale (SCAFFOLD: ``c − c_i`` and ``−lr``; FedDC: ``c/ω_i − c_i``), or
    ``None`` (for a client part that has none in this configuration too)."""

    prox_mu: Callable[[LocalAlgorithm], float]
    shift: Callable[[LocalContext], tuple[list[Tensor], float] | None] | None = None
    pull: Callable[[LocalContext], tuple[float, list[Tensor], list[Tensor] | None]] | None = None
    clip: Callable[[LocalAlgorithm], float] | None = None
    # a loss term against frozen models on the same batch (stacked graph only, engine/stacked.py): the term for the
    # client part (None: off), the frozen models it reads ("received"; "previous": the client's previous model), and
    # per client that previous model (None: the term is absent for the client, as MOON's on a first participation)
    term: Callable[[LocalAlgorithm], FrozenTermFn | None] | None = None
    frozen: tuple[str, ...] = ()
    previous: Callable[[LocalContext], Params | None] | None = None


def _scaffold_shift(ctx: LocalContext) -> tuple[list[Tensor], float]:
    # what Scaffold.begin prepared for its after_step: (the model's parameters, c − c_i per parameter, −lr)
    _, corr, alpha = ctx.scratch["scaffold_shift"]
    return list(corr), float(alpha)


def _feddyn_pull(ctx: LocalContext) -> tuple[float, list[Tensor], list[Tensor] | None]:
    # what FedDyn.begin prepared for its after_backward: (parameters, received w^t, α_k, g_k per parameter)
    _, anchors, alpha, g = ctx.scratch["feddyn"]
    return float(alpha), list(anchors), list(g)


def _feddc_pull(ctx: LocalContext) -> tuple[float, list[Tensor], list[Tensor] | None]:
    # FedDC.begin: (parameters, w^t − h_i, α_i)
    _, anchors, alpha = ctx.scratch["feddc"]
    return float(alpha), list(anchors), None


def _feddc_shift(ctx: LocalContext) -> tuple[list[Tensor], float] | None:
    # FedDC.after_step with correction: θ ← θ − lr·(c/ω_i − c_i)
    shift = ctx.scratch.get("feddc_shift")
    return None if shift is None else (list(shift), -float(ctx.settings.lr))


def _moon_term(algo: LocalAlgorithm) -> FrozenTermFn | None:
    """``Moon.loss``'s model-contrastive term per client: ``mu · mean_b(−pos + logsumexp(pos, neg))``, cosine
    similarities over ``tau`` of the trained body's output with the received and the previous model's."""
    mu, tau = float(algo.mu), float(algo.tau)  # type: ignore[attr-defined]
    if mu == 0:
        return None

    def term(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
        pos = F.cosine_similarity(feats, outs["received"][0], dim=2) / tau
        neg = F.cosine_similarity(feats, outs["previous"][0], dim=2) / tau
        return mu * (-pos + torch.logsumexp(torch.stack([pos, neg], dim=2), dim=2)).mean(1)

    return term


def _moon_previous(ctx: LocalContext) -> Params | None:
    # Moon.begin decided: the contrastive term only with a previous local model
    return ctx.client_state.get("moon_prev") if ctx.scratch.get("moon_contrast") else None


def _ntd_term(algo: LocalAlgorithm) -> FrozenTermFn | None:
    """``FedNTD.loss``'s not-true distillation per client: ``beta · ntd_loss`` with the received model's logits,
    its batch mean taken per client."""
    beta, tau = float(algo.beta), float(algo.tau)  # type: ignore[attr-defined]
    if beta == 0:
        return None

    def term(feats: Tensor, logits: Tensor, y: Tensor, outs: dict[str, tuple[Tensor, Tensor]]) -> Tensor:
        k, b, c = logits.shape
        flat_y = y.reshape(k * b)
        log_p = F.log_softmax(not_true_logits(logits.reshape(k * b, c), flat_y) / tau, dim=1)
        q = F.softmax(not_true_logits(outs["received"][1].reshape(k * b, c), flat_y) / tau, dim=1)
        kl = F.kl_div(log_p, q, reduction="none").view(k, b, -1).sum(dim=(1, 2)) / b
        return beta * tau**2 * kl

    return term


# the client parts whose local step is batched (exact types: a subclass may override any hook)
BATCHED_STEPS: dict[type[LocalAlgorithm], BatchedStep] = {
    LocalAlgorithm: BatchedStep(prox_mu=lambda algo: 0.0),
    FedProx: BatchedStep(prox_mu=lambda algo: float(algo.mu)),  # type: ignore[attr-defined]
    Scaffold: BatchedStep(prox_mu=lambda algo: 0.0, shift=_scaffold_shift),
    FedDyn: BatchedStep(prox_mu=lambda algo: 0.0, pull=_feddyn_pull, clip=lambda algo: float(algo.clip)),  # type: ignore[attr-defined]
    Moon: BatchedStep(
        prox_mu=lambda algo: 0.0, term=_moon_term, frozen=("received", "previous"), previous=_moon_previous
    ),
    FedNTD: BatchedStep(prox_mu=lambda algo: 0.0, term=_ntd_term, frozen=("received",)),
    FedDC: BatchedStep(
        prox_mu=lambda algo: 0.0,
        pull=_feddc_pull,
        clip=lambda algo: float(algo.clip),  # type: ignore[attr-defined]
        shift=_feddc_shift,
    ),
}

# wrappers that add work in ``begin`` only (on the received model, before training) and hand every other hook to the
# client part they wrap: the loss before training that AFL, q-FFL and FedFV read
WRAPPERS: tuple[type[LocalAlgorithm], ...] = (LossBefore,)


def _unwrapped(algo: LocalAlgorithm) -> LocalAlgorithm:
    """The client part whose local step runs: ``algo``, or the one a :data:`WRAPPERS` wrapper hands its hooks to."""
    while type(algo) in WRAPPERS:
        algo = algo.inner  # type: ignore[attr-defined]
    return algo


_RANDOM_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def batchable(method: Method, model: nn.Module | None = None) -> str | None:
    """Why ``method`` (on ``model``, when given) cannot be trained with batched clients; ``None`` when it can.

    Batched: the plain local SGD client (``fedavg``), ``fedprox``, ``scaffold``, ``feddyn`` and ``feddc``, with any
    server plug-in that only aggregates (disco, heal, fedsa, ...) or keeps state-dict groups on the clients (fedper,
    fedbn, local), since those change only what each client receives, or that wrap the client part in
    :data:`WRAPPERS` (the loss before training that AFL, q-FFL and FedFV read). Refused, with the reason: any other
    client part (its hooks run per step of the sequential loop: MOON's contrastive loss, FedRep's and Ditto's phases,
    a personal model), per-client uploads computed after training (FedCAC's masks), a model with random layers
    (dropout) or a cumulative-average BatchNorm (``momentum=None``)."""
    algo = _unwrapped(method.client)
    if type(algo) not in BATCHED_STEPS:
        hooks = [h for h in HOOKS if getattr(type(algo), h, None) is not getattr(LocalAlgorithm, h)]
        known = ", ".join(sorted(a.__name__ for a in BATCHED_STEPS))
        detail = f" and overrides {', '.join(hooks)}" if hooks else ""
        return f"its client part {algo.name!r} is {type(algo).__name__}{detail}; only {known} have a batched local step"
    if method.uploads:
        kinds = ", ".join(type(u).__name__ for u in method.uploads)
        return f"its clients upload tensors computed per client after training ({kinds})"
    if model is not None:
        for name, module in model.named_modules():
            if isinstance(module, _RANDOM_LAYERS):
                return f"the model has a random layer ({name}: {type(module).__name__}); batched draws would differ"
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None:
                return f"the model's BatchNorm {name} uses a cumulative average (momentum=None)"
        if not (hasattr(model, "body") and hasattr(model, "head")):
            return "the model has no body/head split"
        if BATCHED_STEPS[type(algo)].term is not None:
            why = stackable(model.body) or stackable(model.head)
            if why is not None:
                return f"{algo.name}'s term against frozen models is batched for standard-layer models only ({why})"
    return None


@dataclass
class _Schedule:
    """Every client's batches: global row indices into the round's concatenated training tensors."""

    order: np.ndarray  # all clients' epoch permutations, offset to global rows, concatenated
    base: np.ndarray  # [K] where client k's permutations start in ``order``
    n: np.ndarray  # [K] training samples
    bs: np.ndarray  # [K] batch size min(batch_size, n)
    nb: np.ndarray  # [K] batches per epoch
    steps: np.ndarray  # [K] epochs · batches per epoch

    def at(self, t: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Step ``t``'s buckets: ``(batch size, client rows, [rows, size] sample indices)`` per distinct size."""
        active = np.nonzero(t < self.steps)[0]
        if active.size == 0:
            return []
        nb, bs, n = self.nb[active], self.bs[active], self.n[active]
        e, b = t // nb, t % nb
        size = np.minimum(bs, n - b * bs)
        start = self.base[active] + e * n + b * bs
        out = []
        for s in np.unique(size):
            sel = size == s
            out.append((int(s), active[sel], self.order[start[sel][:, None] + np.arange(s)]))
        return out


def _schedule(
    ns: Sequence[int], offsets: Sequence[int], settings: TrainSettings, generators: Sequence[torch.Generator]
) -> _Schedule:
    """The clients' batch orders: ``settings.epochs`` permutations per client drawn from its generator in epoch
    order, as ``local_train`` draws them, with the same batch size and count."""
    n = np.asarray(ns, dtype=np.int64)
    if (n < 1).any():
        raise ValueError(f"every client needs at least one training sample, got sizes {n.tolist()}")
    bs = np.minimum(settings.batch_size, n)
    nb = n // bs if settings.drop_last else -(-n // bs)
    parts = []
    for n_k, off, gen in zip(ns, offsets, generators, strict=True):
        for _ in range(settings.epochs):
            parts.append(torch.randperm(n_k, generator=gen).numpy() + off)
    order = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    base = np.concatenate([[0], np.cumsum(n[:-1] * settings.epochs)]).astype(np.int64)
    return _Schedule(order, base, n, bs, nb, nb * settings.epochs)


class _Flat:
    """The trainable parameters of K clients as one ``[K, D]`` tensor, and named views into any rows of it."""

    def __init__(self, names: list[str], shapes: list[torch.Size]) -> None:
        self.names = names
        self.shapes = shapes
        self.sizes = [math.prod(s) for s in shapes]

    def stack(self, rows: Sequence[Sequence[Tensor]]) -> Tensor:
        """``rows[k]`` (one tensor per name) flattened and stacked: ``[K, D]``."""
        return torch.stack([torch.cat([t.reshape(-1) for t in row]) for row in rows])

    def views(self, flat: Tensor) -> dict[str, Tensor]:
        parts = flat.split(self.sizes, dim=-1)
        return {n: p.view(*flat.shape[:-1], *s) for n, p, s in zip(self.names, parts, self.shapes, strict=True)}


def _step_function(
    model: nn.Module, names: list[str], mu: float, term: FrozenTermFn | None = None
) -> Callable[..., Any]:
    """One step of all clients: their gradients of the cross-entropy of ``head(body(x))`` (+ FedProx's proximal
    term), their losses and their buffers after the forward pass (BatchNorm running statistics). Models made of the
    layers :mod:`fedskew.engine.stacked` knows run as one plain autograd graph over the stacked rows; any other model
    as ``vmap(grad(loss))`` of one client's step."""
    if stackable(model.body) is None and stackable(model.head) is None:
        return stacked_step_function(model, names, mu, term)
    if term is not None:
        raise ValueError("a loss term against frozen models is batched for models of standard layers only")
    return _vmap_step_function(model, names, mu)


def _vmap_step_function(model: nn.Module, names: list[str], mu: float) -> Callable[..., Any]:
    """``vmap(grad(loss))`` of one client's step (any model): the contract of :func:`_step_function`."""
    body_prefix, head_prefix = "body.", "head."

    def client_loss(
        params: dict[str, Tensor], buffers: dict[str, Tensor], anchor: dict[str, Tensor], x: Tensor, y: Tensor
    ) -> tuple[Tensor, tuple[Tensor, dict[str, Tensor]]]:
        state = {**params, **{k: v.clone() for k, v in buffers.items()}}  # the forward updates its own copies
        body = {k[len(body_prefix) :]: v for k, v in state.items() if k.startswith(body_prefix)}
        head = {k[len(head_prefix) :]: v for k, v in state.items() if k.startswith(head_prefix)}
        feats = functional_call(model.body, body, (x,))
        logits = functional_call(model.head, head, (feats,))
        loss = F.cross_entropy(logits, y)
        if mu != 0:  # FedProx.loss: ce + proximal(ctx, ctx.received, mu), over the trained parameters
            loss = loss + 0.5 * mu * torch.stack([((params[n] - anchor[n]) ** 2).sum() for n in names]).sum()
        new_buffers = {k: state[k] for k in buffers}
        return loss, (loss.detach(), new_buffers)

    return vmap(grad(client_loss, has_aux=True))


def train_batched(
    sim: ClientHost,
    rnd: int,
    cids: Sequence[int],
    received: dict[int, Params],
    broadcast: Params,
    max_clients: int | None = None,
) -> list[ClientUpdate]:
    """The uploads ``sim._train(cid, rnd, received[cid], broadcast)`` would return for each of ``cids`` (in that
    order), trained together; each client's ``sim.client_states`` entry advances as there (SCAFFOLD's ``c_i``).

    ``max_clients``: train at most this many clients at once (device memory), the rest in further groups.
    Raises ``ValueError`` when :func:`batchable` refuses the method (the caller falls back to the sequential loop).
    """
    reason = batchable(sim.method, sim.model)
    if reason is not None:
        raise ValueError(f"method {sim.method.name!r} cannot be trained with batched clients: {reason}")
    if max_clients is not None and max_clients < 1:
        raise ValueError(f"max_clients must be >= 1, got {max_clients}")
    group = max_clients or max(len(cids), 1)
    updates: list[ClientUpdate] = []
    for i in range(0, len(cids), group):
        chunk = list(cids[i : i + group])
        updates += _train_group(sim, rnd, chunk, received, broadcast)
    return updates


@dataclass
class _Stack:
    """The per-client tensors of the clients still training, one row each; ``live[r]`` is row r's client (its
    position in the group). Clients that have taken all their steps are retired (their rows kept in ``done``), so
    the steps where every live client shares a batch size, most of them, update the stack in place."""

    live: np.ndarray
    params: Tensor  # [R, D] trainable parameters
    extra: dict[str, Tensor]  # [R, ...] buffers (BatchNorm statistics) and frozen parameters
    loss: Tensor  # [R] float64 sum of batch loss x batch size, as local_train sums it
    buf: Tensor | None = None  # [R, D] SGD momentum buffers
    anchor: Tensor | None = None  # [R, D] received parameters (FedProx's proximal term)
    shift: Tensor | None = None  # [R, D] SCAFFOLD's c - c_i (FedDC's c/ω_i - c_i)
    pull_alpha: Tensor | None = None  # [R] α_k of a pull after the backward pass (FedDyn, FedDC)
    pull_anchor: Tensor | None = None  # [R, D] its anchor
    pull_linear: Tensor | None = None  # [R, D] its linear term (FedDyn's g_k)
    term_mask: Tensor | None = None  # [R] 1 where the frozen-model term applies (MOON), None: everywhere
    frozen_models: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # "received"/"previous" -> [R, ...]
    done: dict[int, tuple[Tensor, dict[str, Tensor], Tensor]] = field(default_factory=dict)

    _ROWS = ("params", "loss", "buf", "anchor", "shift", "pull_alpha", "pull_anchor", "pull_linear", "term_mask")

    def retire(self, keep: np.ndarray, sel: Tensor) -> None:
        """Keep only the rows where ``keep`` holds (``sel``: their positions, on the device); the others' final rows
        go to ``done`` (their loss as a 0-d tensor: no device sync per client)."""
        for r in np.nonzero(~keep)[0]:
            row = {k: v[r].clone() for k, v in self.extra.items()}
            self.done[int(self.live[r])] = (self.params[r].clone(), row, self.loss[r].clone())
        for name in self._ROWS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[sel])
        self.extra = {k: v[sel] for k, v in self.extra.items()}
        self.frozen_models = {m: {k: v[sel] for k, v in rows.items()} for m, rows in self.frozen_models.items()}
        self.live = self.live[keep]


def _upload(a: np.ndarray, device: torch.device) -> Tensor:
    """A host array on ``device`` without waiting for the device: a copy from pageable memory would first wait for
    every queued kernel (a stream sync per step); from pinned memory it is queued like a kernel."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class _Bucket:
    size: int  # batch size of its clients at this step
    rows: int  # how many clients
    sample: slice  # their [rows, size] sample indices, flattened, in the round's index tensor
    pos: slice | None  # their positions among the live rows (None: all of them, in order)


@dataclass
class _StepPlan:
    keep: np.ndarray | None  # retire first: which live rows stay (None: all)
    sel: slice | None  # their positions, in the round's index tensor
    buckets: list[_Bucket]


def _plan(sched: _Schedule, device: torch.device) -> tuple[list[_StepPlan], Tensor]:
    """Every step's retirements and buckets, computed on the host before training, with all their index arrays in
    one tensor uploaded once: the step loop then only slices it and never waits for the device."""
    parts: list[np.ndarray] = []
    used = 0

    def put(a: np.ndarray) -> slice:
        nonlocal used
        parts.append(a.reshape(-1))
        used += a.size
        return slice(used - a.size, used)

    steps: list[_StepPlan] = []
    live = np.arange(sched.n.size)
    for t in range(int(sched.steps.max(initial=0)) + 1):  # the last "step" retires everyone
        buckets = sched.at(t)
        active = np.sort(np.concatenate([rows for _, rows, _ in buckets])) if buckets else np.zeros(0, np.int64)
        keep = sel = None
        if active.size < live.size:
            keep = np.isin(live, active)
            sel = put(np.nonzero(keep)[0])
            live = live[keep]
        planned = []
        for size, rows, idx in buckets:
            pos = None if rows.size == live.size else put(np.searchsorted(live, rows))
            planned.append(_Bucket(size, int(rows.size), put(idx), pos))
        steps.append(_StepPlan(keep, sel, planned))
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return steps, _upload(flat, device)


def _train_group(
    sim: ClientHost, rnd: int, cids: list[int], received: dict[int, Params], broadcast: Params
) -> list[ClientUpdate]:
    method, model, s = sim.method, sim.model, sim.settings
    algo = method.client
    inner = _unwrapped(algo)
    rule = BATCHED_STEPS[type(inner)]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, _ in named]
    flat = _Flat(names, [p.shape for _, p in named])
    order = list(model.state_dict())
    others = [k for k in order if k not in set(names)]  # buffers and frozen parameters, carried per client
    mutable = {n for n, _ in model.named_buffers()}

    # begin: per client, on a real context and the received model in training mode, as local_train calls it
    # (SCAFFOLD initializes c_i and prepares its shift; the loss-before wrapper scores the received model)
    contexts = []
    own_begin = type(algo).begin is not LocalAlgorithm.begin  # the default begin reads nothing of the model
    for cid in cids:
        if own_begin:
            model.load_state_dict(received[cid])
            model.train()
        client = sim.data.clients[cid]
        ctx = LocalContext(
            cid=cid,
            round=rnd,
            model=model,
            received=received[cid],
            client_state=sim.client_states[cid],
            broadcast=broadcast,
            settings=s,
            x=client.x_train,
            y=client.y_train,
            generator=torch_generator(sim.cfg.seed, Purpose.SHUFFLE, cid, rnd),
        )
        algo.begin(ctx)
        contexts.append(ctx)

    xs = [sim.data.clients[c].x_train for c in cids]
    ys = [sim.data.clients[c].y_train for c in cids]
    ns = [x.shape[0] for x in xs]
    offsets = np.concatenate([[0], np.cumsum(ns[:-1])]).astype(np.int64).tolist()
    sched = _schedule(ns, offsets, s, [ctx.generator for ctx in contexts])  # type: ignore[misc]
    x_all, y_all = torch.cat(xs), torch.cat(ys)
    device = x_all.device
    mu = rule.prox_mu(inner)

    with torch.no_grad():
        params = flat.stack([[received[c][n] for n in names] for c in cids]).to(device)
        extra = {k: torch.stack([received[c][k] for c in cids]).to(device) for k in others}
        stack = _Stack(np.arange(len(cids)), params, extra, torch.zeros(len(cids), dtype=torch.float64, device=device))
        stack.buf = torch.zeros_like(params) if s.momentum != 0 else None
        stack.anchor = params.clone() if mu != 0 else None
        alpha = 0.0
        shifts = [rule.shift(ctx) for ctx in contexts] if rule.shift is not None else []
        if shifts and shifts[0] is not None:
            stack.shift = flat.stack([corr for corr, _ in shifts]).to(device)  # type: ignore[misc]
            alpha = shifts[0][1]  # type: ignore[index]
        if rule.pull is not None:
            pulls = [rule.pull(ctx) for ctx in contexts]
            stack.pull_alpha = torch.tensor([a for a, _, _ in pulls], dtype=params.dtype, device=device)
            stack.pull_anchor = flat.stack([anchor for _, anchor, _ in pulls]).to(device)
            if pulls and pulls[0][2] is not None:
                stack.pull_linear = flat.stack([lin for _, _, lin in pulls]).to(device)  # type: ignore[misc]
        clip = rule.clip(inner) if rule.clip is not None else 0.0
        term = rule.term(inner) if rule.term is not None else None
        if term is not None:
            glob = [received[c] for c in cids]
            models = {"received": glob}
            if "previous" in rule.frozen and rule.previous is not None:
                previous = [rule.previous(ctx) for ctx in contexts]
                stack.term_mask = torch.tensor([p is not None for p in previous], dtype=params.dtype, device=device)
                models["previous"] = [p if p is not None else g for p, g in zip(previous, glob, strict=True)]
            stack.frozen_models = {
                m: {k: torch.stack([state[k] for state in states]).to(device) for k in order}
                for m, states in models.items()
                if m in rule.frozen
            }
    step = _step_function(model, names, mu, term)

    plan, index = _plan(sched, device)
    for t, step_plan in enumerate(plan):
        if step_plan.keep is not None:
            stack.retire(step_plan.keep, index[step_plan.sel])
        for bucket in step_plan.buckets:
            size = bucket.size
            pos = None if bucket.pos is None else index[bucket.pos]

            def take(v: Tensor, pos: Tensor | None = pos) -> Tensor:
                return v if pos is None else v[pos]

            p_rows = take(stack.params)
            e_rows = {k: take(v) for k, v in stack.extra.items()}
            fixed = {k: v for k, v in e_rows.items() if k not in mutable}
            bufs = {k: v for k, v in e_rows.items() if k in mutable}
            anchor = flat.views(take(stack.anchor)) if stack.anchor is not None else {}
            sample = index[bucket.sample].view(bucket.rows, size)
            rows = None
            if stack.frozen_models:
                frozen = {m: {k: take(v) for k, v in st.items()} for m, st in stack.frozen_models.items()}
                rows = (frozen, None if stack.term_mask is None else take(stack.term_mask))
            args = ({**flat.views(p_rows), **fixed}, bufs, anchor, x_all[sample], y_all[sample])
            grads, (loss, new_bufs) = step(*args, rows) if rows is not None else step(*args)
            with torch.no_grad():  # torch.optim.SGD's step, per parameter tensor, on views of the stacked rows
                p_list = list(flat.views(p_rows).values())
                g = [grads[n] for n in names]
                if stack.pull_anchor is not None:  # after_backward: grad += α_k(θ − anchor) − linear, then clip
                    g = _pull(
                        g,
                        p_list,
                        take(stack.pull_alpha),
                        flat.views(take(stack.pull_anchor)).values(),
                        (flat.views(take(stack.pull_linear)).values() if stack.pull_linear is not None else None),
                    )
                    if clip > 0:
                        g = _clip_rows(g, clip)
                if s.weight_decay != 0:
                    g = torch._foreach_add(g, p_list, alpha=s.weight_decay)
                if stack.buf is not None:  # buf = g on a client's first step (step 0 for all), then buf·β + g
                    b_rows = take(stack.buf)
                    b_list = list(flat.views(b_rows).values())
                    if t == 0:
                        torch._foreach_copy_(b_list, g)
                    else:
                        torch._foreach_mul_(b_list, s.momentum)
                        torch._foreach_add_(b_list, g, alpha=1.0)
                    if pos is not None:
                        stack.buf.index_copy_(0, pos, b_rows)
                    g = b_list
                torch._foreach_add_(p_list, g, alpha=-s.lr)
                if stack.shift is not None:  # SCAFFOLD's after_step: w += −lr·(c − c_i), outside the optimizer
                    p_rows.add_(take(stack.shift), alpha=alpha)
                batch_loss = (loss * size).double()  # local_train: loss_sum += loss · batch size (float64)
                if pos is None:
                    stack.loss.add_(batch_loss)
                    stack.extra.update(new_bufs)
                else:
                    stack.params.index_copy_(0, pos, p_rows)
                    stack.loss.index_add_(0, pos, batch_loss)
                    for k, v in new_bufs.items():
                        stack.extra[k] = stack.extra[k].index_copy(0, pos, v)

    updates = []
    seen = (sched.nb * sched.bs if s.drop_last else sched.n) * s.epochs  # samples per client over all steps
    override_end = type(algo).end is not LocalAlgorithm.end
    loss_sums = torch.stack([stack.done[k][2] for k in range(len(cids))]).tolist()  # one device sync
    for k, (cid, ctx) in enumerate(zip(cids, contexts, strict=True)):
        row, rest, _ = stack.done[k]
        loss_sum = loss_sums[k]
        mine = flat.views(row)
        trained = {key: (mine[key] if key in mine else rest[key]) for key in order}
        ctx.steps = int(sched.steps[k])
        extras: Params = {}
        if override_end:  # the client part's own end on the trained model (SCAFFOLD: c_i⁺ and Δc_i)
            model.load_state_dict(trained)
            extras = algo.end(ctx)
        updates.append(
            ClientUpdate(
                cid=cid,
                params=trained,
                num_samples=ns[k],
                extras=extras,
                metrics={**ctx.metrics, "train_loss": loss_sum / max(int(seen[k]), 1), "steps": float(ctx.steps)},
            )
        )
    return updates


def _pull(grads: list[Tensor], params: list[Tensor], alpha: Tensor, anchors: Any, linear: Any | None) -> list[Tensor]:
    """``client.drift.add_pull`` on stacked rows: ``g + α_k·(θ − anchor) − linear`` per parameter tensor."""
    out = []
    lin = list(linear) if linear is not None else [None] * len(grads)
    for g, p, a, li in zip(grads, params, list(anchors), lin, strict=True):
        scale = alpha.view(-1, *([1] * (g.dim() - 1)))
        g = g + scale * (p - a)
        out.append(g if li is None else g - li)
    return out


def _clip_rows(grads: list[Tensor], clip: float) -> list[Tensor]:
    """``torch.nn.utils.clip_grad_norm_(params, clip)`` per client row: each client's gradients scaled by
    ``min(1, clip / (‖g‖ + 1e-6))``, ``‖g‖`` the 2-norm over all its parameter tensors."""
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads], dim=1)
    coef = (clip / (torch.linalg.vector_norm(norms, dim=1) + 1e-6)).clamp(max=1.0)
    return [g * coef.view(-1, *([1] * (g.dim() - 1))) for g in grads]


def round_batched(sim: RoundHost, rnd: int, max_clients: int | None = None) -> RoundResult:
    """``sim.round(rnd)`` with the reporting clients trained by :func:`train_batched`: the same sampling, drop-outs,
    received models (personal, local entries overlaid), upload checks, aggregation, evaluation and record."""
    plan = sim.open_round(rnd)
    cids = [c for c in plan.sampled if c not in plan.gone]
    received = {c: sim.params_for(c) for c in cids}
    for update in train_batched(sim, rnd, cids, received, plan.broadcast, max_clients):
        sim.take_upload(plan, update)
    return sim.close_round(plan)
