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
  the batched form each client part declares beside its hooks (``LocalAlgorithm.batched_step``: FedProx's proximal
  term, SCAFFOLD's shift after the step; :mod:`fedskew.client.batched_form`).

Anything else (a client part without a declared form, a randomized model, a term on a model without a stacked form)
is refused by :func:`batchable` with the reason, and the engine trains such a method sequentially. Each client gets
what it alone is sent (``sent``: the broadcast with a server half's downloads, FedFomo's peers).

Float rounding differs (a vmapped convolution or linear layer sums in another order than the module's kernel, about
1e-8 per gradient), so models usually agree to 1e-7 after a round (tests/test_batched_clients.py checks 1e-5). Local
SGD can amplify that rounding: where a pre-activation sits within rounding distance of a ReLU's zero, one ulp decides
the branch. The sequential loop started from its input moved by one ulp differs from itself by as much
(docs/_fragments/batched.md, ``benchmarks/batched_clients.py --noise-floor``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from fedskew.client.batched_form import BatchedStep, GeneratedTerm
from fedskew.client.local import LocalAlgorithm, LocalContext, batched_form, check_state, snapshot
from fedskew.engine.batched_rows import Beside, Collect, PhasePlan, PhaseRows, phase_plans, phase_stack
from fedskew.engine.batched_schedule import Schedule, plan_steps, schedule
from fedskew.engine.batched_steps import (
    Flat,
    StepRows,
    batchable,
    blend_rows,
    clip_rows,
    envelope_gradient,
    inner_gradient,
    pull_rows,
    sam_ascent,
)
from fedskew.engine.captured import PaddedCache, capture_refusal, run_padded
from fedskew.engine.padded_shape import PaddedRows
from fedskew.engine.stacked_step import ENV_THETA
from fedskew.engine.step_functions import step_function
from fedskew.protocol import STEPS, TRAIN_LOSS, Params, Upload
from fedskew.seeding import Purpose, torch_generator
from fedskew.server.api import ServerHalf
from fedskew.server.uploads import nonfinite_each

if TYPE_CHECKING:  # annotations only: the simulation is seen through engine/host.py, never engine/loop.py
    from fedskew.engine.host import ClientHost, RoundHost
    from fedskew.engine.rounds import RoundResult


def train_batched(
    sim: ClientHost,
    rnd: int,
    cids: Sequence[int],
    received: dict[int, Params],
    broadcast: Params,
    max_clients: int | None = None,
    capture: bool | PaddedCache = False,
    sent: Mapping[int, Params] | None = None,
    conv: str = "grouped",
) -> list[Upload]:
    """The uploads ``sim._train(cid, rnd, received[cid], broadcast)`` would return for each of ``cids`` (in that
    order), trained together; each client's ``sim.client_states`` entry advances as there (SCAFFOLD's ``c_i``).

    ``sent``: what each client is sent beside its model, where a server half sends some clients tensors of their own
    (``downloads``: FedFomo's peer models; the round server's ``sent_to``); ``None``: ``broadcast`` for every
    client, which a server half with downloads refuses (``ValueError``). Only the per-client hooks (``begin``,
    ``end``, a form's per-client pieces) read a client's own; what a form builds once for the round reads the first
    client's context, so it may read only what every client is sent alike.

    ``max_clients``: train at most this many clients at once (device memory), the rest in further groups.
    ``capture``: every step at one of a few shapes, padded and masked (:mod:`fedskew.engine.captured`), replayed as
    CUDA graphs on a CUDA device; ``ValueError`` when :func:`~fedskew.engine.captured.capture_refusal` refuses it.
    A :class:`~fedskew.engine.captured.PaddedCache` keeps the graphs for the next call of the same shape. ``conv``:
    the stacked convolutions' form (:data:`~fedskew.engine.stacked.CONV_FORMS`).
    Raises ``ValueError`` when :func:`batchable` refuses the method (the caller falls back to the sequential loop).
    """
    reason = batchable(sim.method, sim.model, sim.settings.precision)
    if reason is not None:
        raise ValueError(f"method {sim.method.name!r} cannot be trained with batched clients: {reason}")
    if sent is None and type(sim.method.server_half).downloads is not ServerHalf.downloads:
        raise ValueError(
            f"method {sim.method.name!r} sends each client tensors of its own (its server half's downloads): "
            "train_batched needs them as sent={client: what it is sent}"
        )
    if sent is not None and (missing := [c for c in cids if c not in sent]):
        raise ValueError(f"sent has nothing for client(s) {missing[:5]}: give every trained client what it is sent")
    if max_clients is not None and max_clients < 1:
        raise ValueError(f"max_clients must be >= 1, got {max_clients}")
    group = max_clients or max(len(cids), 1)
    cache = capture if isinstance(capture, PaddedCache) else PaddedCache() if capture else None
    updates: list[Upload] = []
    for i in range(0, len(cids), group):
        chunk = list(cids[i : i + group])
        mine = {c: broadcast for c in chunk} if sent is None else {c: sent[c] for c in chunk}
        updates += _train_group(sim, rnd, chunk, received, mine, cache, conv)
    return updates


def client_seed(host: ClientHost, cid: int) -> int:
    """The seed of the run client ``cid`` belongs to: the host's, or, for a host of several runs
    (:class:`~fedskew.engine.stacked_runs.StackedRuns`), that client's own run's."""
    seed_of = getattr(host, "seed_of", None)
    return int(seed_of(cid)) if seed_of is not None else int(host.cfg.seed)


def cid_in_run(host: ClientHost, cid: int) -> int:
    """The client's id in its own run (a host of several runs numbers its runs' clients one after the other)."""
    local = getattr(host, "cid_in_run", None)
    return int(local(cid)) if local is not None else cid


def _train_group(
    sim: ClientHost,
    rnd: int,
    cids: list[int],
    received: dict[int, Params],
    sent: dict[int, Params],
    capture: PaddedCache | None = None,
    conv: str = "grouped",
) -> list[Upload]:
    method, model, s = sim.method, sim.model, sim.settings
    algo = method.client
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    order = list(model.state_dict())

    # begin: per client, on a real context and the received model in training mode, as local_train calls it
    # (SCAFFOLD initializes c_i and prepares its shift; the loss-before wrapper scores the received model)
    contexts = []
    rule = batched_form(algo)
    assert not isinstance(rule, str), rule  # train_batched checked batchable()
    why = capture_refusal(rule, model) if capture is not None else None
    if why is not None:
        raise ValueError(f"batched clients cannot run method {method.name!r} at one shape: {why}")
    begun: dict[int, Params] = {}
    own_begin = type(algo).begin is not LocalAlgorithm.begin  # the default begin reads nothing of the model
    for cid in cids:
        client = sim.data.clients[cid]
        ctx = LocalContext(
            cid=cid_in_run(sim, cid),
            round=rnd,
            model=model,
            received=received[cid],
            client_state=sim.client_states[cid],
            broadcast=sent[cid],
            settings=s,
            x=client.x_train,
            y=client.y_train,
            x_val=client.x_val,
            y_val=client.y_val,
            generator=torch_generator(client_seed(sim, cid), Purpose.SHUFFLE, cid_in_run(sim, cid), rnd),
        )
        contexts.append(ctx)
    starts = rule.begin_all(contexts) if rule.begin_all is not None else None  # every begin at once (FedALA)
    if starts is not None and rule.start_after_begin:
        begun = dict(zip(cids, starts, strict=True))
    for cid, ctx in zip(cids, contexts, strict=True) if starts is None else ():  # each begin in turn, as local_train
        if own_begin:
            model.load_state_dict(ctx.received)
            model.train()
        algo.begin(ctx)
        if rule.start_after_begin:  # FedALA: its begin built the client's start in the model
            begun[cid] = snapshot(model)

    xs = [sim.data.clients[c].x_train for c in cids]
    ys = [sim.data.clients[c].y_train for c in cids]
    ns = [x.shape[0] for x in xs]
    offsets = np.concatenate([[0], np.cumsum(ns[:-1])]).astype(np.int64).tolist()
    x_all, y_all = torch.cat(xs), torch.cat(ys)
    k_all = len(cids)
    states: list[Params] = [begun.get(c, received[c]) for c in cids]  # each client's model, phase after phase
    loss_sums = torch.zeros(k_all, dtype=torch.float64, device=x_all.device)
    seen = np.zeros(k_all, dtype=np.int64)
    steps = np.zeros(k_all, dtype=np.int64)
    generated = rule.generated(contexts[0]) if rule.generated is not None else None
    for phase in phase_plans(algo, contexts, trainable):
        for ctx in contexts:
            ctx.phase = phase.name
        starts = [st if st is not None else states[k] for k, st in enumerate(phase.starts)]
        # each phase draws its epochs' permutations from the client's generator after the previous phase's, as the
        # sequential loop does
        gens = [ctx.generator for ctx in contexts]
        draw = generated.draw if generated is not None else None
        sched = schedule(ns, offsets, replace(s, epochs=phase.epochs), gens, draw)  # type: ignore[arg-type]
        states, phase_loss = _run_phase(
            sim, rule, contexts, cids, received, starts, phase, sched, x_all, y_all, order, generated, capture, conv
        )
        loss_sums += phase_loss
        seen += (sched.nb * sched.bs if s.drop_last else sched.n) * phase.epochs
        steps += sched.steps
        if phase.keep is not None:
            for ctx, state in zip(contexts, states, strict=True):
                ctx.keep(phase.keep, {k: v.clone() for k, v in state.items()})

    updates = []
    override_end = type(algo).end is not LocalAlgorithm.end
    trainable_set = frozenset(trainable)
    losses = loss_sums.tolist()  # one device sync
    for k, (cid, ctx) in enumerate(zip(cids, contexts, strict=True)):
        trained = states[k]
        ctx.steps = int(steps[k])
        extras: Params = {}
        if override_end:  # the client part's own end on the trained model (SCAFFOLD: c_i⁺ and Δc_i); what it leaves
            model.load_state_dict(trained)  # in the model is the upload (FedBABU reloads its body-trained model)
            extras = algo.end(ctx)
            trained = snapshot(model)
        for up in method.upload_extras:  # tensors computed from the received and the trained model (FedCAC's masks)
            extras = {**extras, **up(ctx.received, trained, trainable_set)}
        check_state(algo, ctx.client_state)  # as the sequential loop checks it
        updates.append(
            Upload(
                cid=cid,
                params=trained,
                num_samples=ns[k],
                extras=extras,
                metrics={**ctx.metrics, TRAIN_LOSS: losses[k] / max(int(seen[k]), 1), STEPS: float(ctx.steps)},
            )
        )
    return updates


def _run_phase(
    sim: ClientHost,
    rule: BatchedStep,
    contexts: list[LocalContext],
    cids: list[int],
    received: dict[int, Params],
    starts: list[Params],
    phase: PhasePlan,
    sched: Schedule,
    x_all: Tensor,
    y_all: Tensor,
    order: list[str],
    generated: GeneratedTerm | None = None,
    capture: PaddedCache | None = None,
    conv: str = "grouped",
) -> tuple[list[Params], Tensor]:
    """One phase of every client's training from ``starts``: the clients' full state dicts after it and their summed
    ``batch loss × batch size`` (float64), as ``local_train``'s phase loop computes them."""
    model, s = sim.model, sim.settings
    lr = s.lr if phase.lr is None else phase.lr
    names = phase.trains  # this phase's trained parameters; every other entry is carried per client
    flat = Flat(names, [starts[0][n].shape for n in names])
    mutable = {n for n, _ in model.named_buffers()}
    device = x_all.device
    mu = rule.prox_mu(phase.name) if rule.prox_mu is not None else 0.0

    term = rule.term(contexts[0]) if rule.term is not None else None
    own_term = rule.client_term(contexts[0]) if rule.client_term is not None else None
    source = PhaseRows(cids, received, starts, flat, order, sim.data.num_classes, device)
    stack = phase_stack(rule, contexts, source, s.momentum, mu, term, own_term)
    alpha, share, clip = stack.shift_scale, stack.blend_share, rule.clip
    with torch.no_grad():
        beside = Beside(rule, contexts, stack, s.lr, flat)  # FedRoD's personal head, FedDBE's bias and running mean
    decays = [rule.decay(n) for n in names] if rule.decay is not None else []
    decayed = any(decays)  # once per phase, not per step
    head_draws = [rule.head_draw(ctx) for ctx in contexts] if rule.head_draw is not None else []
    collect = Collect([rule.collect(ctx) for ctx in contexts], sim.data.num_classes, device) if rule.collect else None
    # every step at one of a few shapes (engine/captured.py; _train_group checked capture_refusal)
    if capture is not None:
        given = PaddedRows(
            params=stack.params,
            fixed={k: v for k, v in stack.extra.items() if k not in Beside.KEYS},
            anchor=stack.anchor,
            shift=None if stack.shift is None else (stack.shift, alpha),
            pull=None if stack.pull_anchor is None else (stack.pull_alpha, stack.pull_anchor, stack.pull_linear),
            logit_map=None if rule.logits is None else (stack.logit_scale, stack.logit_shift),
            blend=None if share is None else (share, stack.blend_dir),
            beside=beside if beside else None,
            beside_rows={k: v for k, v in stack.extra.items() if k in Beside.KEYS},
            term=None if term is None else (term, stack.frozen_models, stack.term_mask),
            collect=None if collect is None else (sim.data.num_classes, collect.start),
            generated=None
            if generated is None or sched.drawn is None
            else (generated, tuple(t.to(device) for t in sched.drawn)),
            client_term=own_term,
            reads=stack.reads,
            head_draws=head_draws or None,
        )
        result = run_padded(model, rule, s, lr, mu, flat, sched, x_all, y_all, given, capture, conv)
        beside.hand_back_rows(result.beside)
        if collect is not None:  # FedProto/FPL: the last epoch's class sums, where each client's end reads them
            collect.sums, collect.counts = result.sums, result.counts  # type: ignore[assignment]
            collect.hand_over()
        others = {key: v.unbind(0) for key, v in {**stack.extra, **(result.fixed or {})}.items()}
        states = [
            {key: (mine[key] if key in mine else others[key][k]) for key in order}
            for k, mine in enumerate(flat.rows(result.params))
        ]
        return states, result.losses
    # training mode, as local_train sets it: vmap's functional_call runs the modules in their current mode, and the
    # model comes here from an evaluation (eval mode: BatchNorm would normalize by its running statistics)
    model.train()
    draw_name = head_draws[0].name if head_draws else None
    head_term = generated.term if generated is not None else None
    step = step_function(model, names, mu, term, head_term, own_term, draw_name, conv, s.precision)
    drawn_all = None if sched.drawn is None else tuple(t.to(device) for t in sched.drawn)

    plan, index = plan_steps(sched, device)
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
            fixed = {k: v for k, v in e_rows.items() if k not in mutable and k not in Beside.KEYS}
            bufs = {k: v for k, v in e_rows.items() if k in mutable}
            anchor = flat.views(take(stack.anchor)) if stack.anchor is not None else {}
            sample = index[bucket.sample].view(bucket.rows, size)
            rows = None
            if term is not None:
                frozen = {m: {k: take(v) for k, v in st.items()} for m, st in stack.frozen_models.items()}
                rows = (frozen, None if stack.term_mask is None else take(stack.term_mask))
            args = ({**flat.views(p_rows), **fixed}, bufs, anchor, x_all[sample], y_all[sample])
            mapped = beside.step_args(e_rows)
            if rule.logits is not None:
                scale, shift = (None if v is None else take(v) for v in (stack.logit_scale, stack.logit_shift))
                mapped["logit_map"] = (scale, shift)
            if stack.reads:  # a client term's rows of the received entries it reads (none read: nothing mapped)
                mapped["reads"] = {k: take(v) for k, v in stack.reads.items()}
            if head_draws:  # each client's draws for this step from its own stream, in its step order (FedCP)
                assert bucket.clients is not None
                mapped["head_draws"] = torch.stack([head_draws[k].draw(size) for k in bucket.clients.tolist()])
            drawn = None
            if drawn_all is not None and generated is not None and bucket.drawn is not None:
                at = index[bucket.drawn]
                with torch.no_grad():
                    drawn = generated.inputs(*(t[at] for t in drawn_all))
            tail = (rows, drawn) if drawn is not None else (rows,) if rows is not None else ()
            theta = None
            if rule.inner is not None:  # Per-FedAvg: the direction through an inner step, its passes on these rows
                batch = StepRows(flat.views(p_rows), fixed, bufs, *args[3:])
                grads, loss, new_bufs = inner_gradient(step, batch, names, rule.inner, s.lr)
                feats = []
            elif beside.envs:  # pFedMe: θ solved on the batch, the model pulled towards it
                batch = StepRows(flat.views(p_rows), fixed, bufs, *args[3:])
                env, rows_theta = beside.envs[0], flat.views(e_rows[ENV_THETA])
                grads, loss, new_bufs, theta = envelope_gradient(step, batch, env, rows_theta)
                feats = []
            else:
                grads, (loss, new_bufs, *feats) = step(*args, *tail, **mapped)
            if collect is not None:  # FedProto/FedProc: the last epoch's class sums of the features, per client
                collect.add(t, index[bucket.members], feats[0], y_all[sample])
            p_list = list(flat.views(p_rows).values())  # views: args[0] holds the same rows
            g = [grads[n] for n in names]
            if rule.sam_rho > 0:  # FedSAM: the gradient at w + ε on the same batch, w restored as fedsam restores it
                with torch.no_grad():
                    eps = sam_ascent(g, rule.sam_rho)
                    torch._foreach_add_(p_list, eps)
                perturbed, _ = step(*args, *tail, **mapped)  # its buffers are discarded (SAM's frozen statistics)
                with torch.no_grad():
                    torch._foreach_sub_(p_list, eps)
                g = [perturbed[n] for n in names]
            with torch.no_grad():  # torch.optim.SGD's step, per parameter tensor, on views of the stacked rows
                carried = beside.advance(e_rows, grads, feats[0] if feats else None) if beside else {}
                if theta is not None:
                    carried[ENV_THETA] = torch.cat([theta[n].flatten(1) for n in names], dim=1)
                for key, rows_now in carried.items():
                    stack.extra[key] = rows_now if pos is None else stack.extra[key].index_copy(0, pos, rows_now)
                if decayed:  # after_backward: μ·θ added to the decayed parameters' gradients (GPFL)
                    g = [gi + d * p if d else gi for gi, p, d in zip(g, p_list, decays, strict=True)]
                if share is not None:
                    direction = None if stack.blend_dir is None else flat.views(take(stack.blend_dir)).values()
                    g = blend_rows(g, share, direction)
                if stack.pull_anchor is not None:  # after_backward: grad += α_k(θ − anchor) − linear, then clip
                    g = pull_rows(
                        g,
                        p_list,
                        take(stack.pull_alpha),
                        flat.views(take(stack.pull_anchor)).values(),
                        (flat.views(take(stack.pull_linear)).values() if stack.pull_linear is not None else None),
                    )
                    if clip > 0:
                        g = clip_rows(g, clip)
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
                torch._foreach_add_(p_list, g, alpha=-lr)
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

    if collect is not None:
        collect.hand_over()
    beside.hand_back(stack)
    out = []
    for k in range(len(cids)):
        row, rest, _ = stack.done[k]
        mine = flat.views(row)
        out.append({key: (mine[key] if key in mine else rest[key]) for key in order})
    return out, torch.stack([stack.done[k][2] for k in range(len(cids))])


def round_batched(sim: RoundHost, rnd: int, max_clients: int | None = None) -> RoundResult:
    """``sim.round(rnd)`` with the reporting clients trained by :func:`train_batched`: the same sampling, drop-outs,
    received models (personal, local entries overlaid), upload checks, aggregation, evaluation and record."""
    plan = sim.open_round(rnd)
    cids = [c for c in plan.sampled if c not in plan.gone]
    received = {c: sim.params_for(c) for c in cids}
    sent = {c: sim.sent_to(plan, c) for c in cids}
    trained = train_batched(sim, rnd, cids, received, plan.broadcast, max_clients, sent=sent)
    for update, bad in zip(trained, nonfinite_each(trained), strict=True):  # their finiteness in one device sync
        sim.take_upload(plan, update, bad)
    return sim.close_round(plan)
