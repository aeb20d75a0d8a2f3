"""Batched steps at one shape (engine/captured.py) against the sequential loop, and the refusals.

On a CPU the padded, masked steps run eagerly: the same computation a CUDA device captures once per width and
replays. Each case trains two identical simulations side by side, one client after the other and batched with
``capture=True``, over two rounds (the second from the aggregated models), at the batched path's tolerance (1e-5).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import digits_simulation, run_records
from test_batched_clients import _close, _same_states, _same_updates, _side_by_side

from fedskew.client.batched_form import BatchedStep, InnerStep
from fedskew.engine.batched import train_batched
from fedskew.engine.batched_schedule import schedule
from fedskew.engine.captured import capture_refusal
from fedskew.engine.graph_replay import StepReplay
from fedskew.engine.padded_plan import PaddedPlan, ladder, step_widths
from fedskew.models import build_model


def mlp_model():
    return build_model("mlp", in_channels=1, image_size=8, num_classes=10)


# 10 clients: steps run wider than their live rows (with 4, every width of the ladder is taken)
TEN = {"clients": 10, "batch_size": 16}


@pytest.mark.parametrize(
    ("method", "args", "over"),
    [
        ("fedavg", None, {}),
        ("fedavg", None, {"model": "lenet", "momentum": 0.9, "weight_decay": 1e-3, "lr": 0.01, "batch_size": 24}),
        ("fedprox", {"mu": 0.1}, {"batch_size": 200}),  # a client with n < batch_size: one batch of n
        ("scaffold", None, {"momentum": 0.5, "local_epochs": 2}),  # the shift after each step; last batches mid-way
        ("fedavg+fedper", None, {"drop_last": True, "batch_size": 24}),
        ("feddyn", {"alpha": 0.1, "clip": 0.5}, {}),  # the pull and g_k after the backward pass, clipping active
        ("ditto", {"lam": 0.5}, {"momentum": 0.5}),  # two phases, each its own padded plan and optimizer
        ("fedrep", {"head_epochs": 2}, {"batch_size": 32}),  # a phase trains the head only: the body rows are fixed
        ("fedavg+disco", None, {"momentum": 0.9}),
        ("fedlc", {"tau": 0.5}, {"batch_size": 24}),  # each row's own logit shift, padded rows included
        ("fedrs+fedper", {"alpha": 0.3}, {"momentum": 0.5}),  # each row's own logit scale
        ("fedsam", {"rho": 0.1}, {"batch_size": 24}),  # two passes a step; a padded row's ε is 0
        ("mofedsam", {"alpha": 0.3}, {"momentum": 0.5}),  # and the blend with Δ, masked on padded rows
        # trained beside the model (engine/batched_rows.py's Beside), in buffers of their own, masked as the model
        ("fedrod", None, {"momentum": 0.5, "weight_decay": 1e-3, **TEN}),  # the personal head, balanced softmax
        ("fedrod", {"generic_loss": "ce"}, {"batch_size": 24}),
        ("feddbe", {"mean_momentum": 0.5, "kappa": 5.0}, {"momentum": 0.5, **TEN}),  # a finished row's r kept
        ("apfl", None, {"momentum": 0.5, "weight_decay": 1e-3, **TEN}),  # an adaptive α, whose l2 the mask stops
        ("apfl", {"adaptive": False, "alpha": 0.3}, {"batch_size": 24}),
        # a per-sample term against frozen models, over the real samples: MOON (its mask: no previous model in round
        # 1, one in round 2) and FedNTD (the received model's logits)
        ("moon", {"mu": 1.0}, {"momentum": 0.5, **TEN}),
        ("fedntd", {"beta": 1.0}, {"momentum": 0.5, **TEN}),
        # a per-sample term on the round's prototypes (a new function each round) and the last epoch's class sums
        # over the real samples (each row from its own last epoch's first step)
        ("fedproto", {"lam": 1.0}, {"momentum": 0.5, "local_epochs": 2, **TEN}),
        ("fpl", None, {"local_epochs": 2, **TEN}),
        ("fedproc", {"curriculum_rounds": 4}, {"momentum": 0.5, "local_epochs": 2, **TEN}),  # round 2: α = 2/3
        ("fedpac", None, {"momentum": 0.5, **TEN}),  # its body phase's alignment term, then its head phase
        # a statistic of each batch over its real samples (FedDecorr's decorrelation), alone and beside a per-sample
        # host term
        ("feddecorr", {"beta": 1e-3}, {"momentum": 0.5, **TEN}),
        ("fedntd+feddecorr", {"feddecorr.beta": 1e-3}, TEN),
        # inner steps: Per-FedAvg's slices of each row's own batch as masks (odd last batches: slices of unequal
        # length, one past a batch's end), pFedMe's θ rows solved at every step and kept exactly on a finished row
        ("perfedavg", None, {"momentum": 0.5, **TEN}),
        ("perfedavg", {"variant": "hf", "alpha": 0.02}, {"batch_size": 33}),
        ("pfedme", {"lam": 5.0, "inner_steps": 3, "mu": 0.01}, {"momentum": 0.5, **TEN}),
        # inputs drawn per client and step through the round's generator (FedGen): a finished row reads its last draw,
        # its update masked out
        ("fedgen", None, {"momentum": 0.5, **TEN}),
        # BatchNorm: each row's batch statistics over its real samples, its running statistics (and the count of
        # batches) moved on the rows with a batch only; FedBN keeps them local; MOON's frozen models in eval mode
        ("fedavg", None, {"model": "lenet_bn", "momentum": 0.5, **TEN}),
        ("fedavg+fedbn", None, {"model": "lenet_bn", "weight_decay": 1e-3, **TEN}),
        ("moon", {"mu": 1.0}, {"model": "lenet_bn", **TEN}),
        ("fedsam", {"rho": 0.1}, {"model": "lenet_bn", "momentum": 0.5, **TEN}),  # its second pass's statistics kept
        # a second pass beside BatchNorm: the first pass moves the statistics, the later ones run on copies, each over
        # its own real samples (an inner step's slice, θ's passes, APFL's mixed model)
        ("perfedavg", None, {"model": "lenet_bn", "momentum": 0.5, **TEN}),
        ("perfedavg", {"variant": "hf", "alpha": 0.02}, {"model": "lenet_bn", "batch_size": 33}),
        ("pfedme", {"lam": 5.0, "inner_steps": 2}, {"model": "lenet_bn", **TEN}),
        ("apfl", None, {"model": "lenet_bn", "momentum": 0.5, **TEN}),
        # a client's own term by its stacked form over the real samples, through a composite head's own stacked form
        # (its buffers read as inputs): GPFL's global path (the received embeddings' rows) and its decay, FedCP's MMD
        # to the received body's features and each row's Gumbel draws for its real samples from its own stream
        ("gpfl", {"lam": 0.5}, {"momentum": 0.5, **TEN}),
        ("gpfl", {"mu": 0.3}, {"model": "lenet_bn", "weight_decay": 1e-3, **TEN}),
        ("fedcp", None, {"momentum": 0.5, "local_epochs": 2, **TEN}),  # draws after a short last batch
        ("fedcp", {"lam": 1.0}, {"model": "lenet_bn", **TEN}),
    ],
)
def test_padded_steps_match_the_sequential_loop(one_thread, method, args, over):
    seq, bat, rounds = _side_by_side(method, args, capture=True, **over)
    for received, _, ups_seq, ups_bat in rounds:
        _same_updates(ups_seq, ups_bat)
        for u in ups_seq:  # the clients did train
            moved = max((u.params[k] - received[u.cid][k]).abs().max().item() for k in seq.trainable)
            assert moved > 1e-3
    assert len({u.metrics["steps"] for u in rounds[0][2]}) > 1  # clients finish at different steps (masked rows)
    _same_states(seq.client_states, bat.client_states)
    for k in seq.global_params:
        _close(seq.global_params[k], bat.global_params[k], f"global {k}")


def test_a_finished_row_stays_exactly_as_it_finished(one_thread):
    """The clients that finish first keep their rows bit for bit while the others train on (momentum, weight decay
    and FedProx's pull would move them if the mask let a zero gradient through): the shortest client trained alone
    with capture gives the very same tensors as trained in the group."""
    over = {"momentum": 0.9, "weight_decay": 1e-2, **TEN}
    sims = [digits_simulation("fedprox", {"mu": 0.5}, **over) for _ in range(2)]
    cids = list(range(10))
    sizes = [c.x_train.shape[0] for c in sims[0].data.clients]
    short = int(np.argmin(sizes))
    steps = np.array([-(-n // 16) for n in sizes])  # one epoch of batches of 16
    assert step_widths(steps)[int(steps.min())] > (steps > steps.min()).sum()  # its row in a step after it finished
    group = train_batched(sims[0], 1, cids, {c: sims[0].params_for(c) for c in cids}, {}, capture=True)
    alone = train_batched(sims[1], 1, [short], {short: sims[1].params_for(short)}, {}, capture=True)
    for k, v in alone[0].params.items():
        assert torch.equal(group[short].params[k], v), k


def test_refusals_name_what_cannot_be_padded():
    rule = BatchedStep()
    assert capture_refusal(rule, build_model("mlp", in_channels=1, image_size=8, num_classes=10)) is None
    bn = build_model("lenet_bn", in_channels=1, image_size=8, num_classes=10)
    assert capture_refusal(rule, bn) is None  # its batch statistics over each client's real samples
    assert capture_refusal(BatchedStep(sam_rho=0.1), bn) is None  # SAM's second pass restores the statistics
    for second in (BatchedStep(mixture=lambda ctx: None), BatchedStep(inner=InnerStep(2, None, False, 0.0))):
        assert capture_refusal(second, bn) is None  # the later passes on copies of the statistics
    stateless = build_model("mlp", in_channels=1, image_size=8, num_classes=10)  # BatchNorm without running stats
    stateless.body = torch.nn.Sequential(*stateless.body, torch.nn.BatchNorm1d(200, track_running_stats=False))
    assert capture_refusal(rule, stateless) is None
    other = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    other.head.register_buffer("table", torch.zeros(3))
    assert "buffers other than BatchNorm's statistics (head)" in (capture_refusal(rule, other) or "")
    res = build_model("resnet8", in_channels=1, image_size=8, num_classes=10)
    assert "no stacked form" in (capture_refusal(rule, res) or "")
    term = BatchedStep(term=lambda ctx: None)  # a term per client: its batch mean cannot leave the padding out
    assert capture_refusal(BatchedStep(term=lambda ctx: None, term_per_sample=True), mlp_model()) is None
    assert "loss term" in (capture_refusal(term, build_model("mlp", in_channels=1, image_size=8, num_classes=10)) or "")
    mlp = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    own = BatchedStep(client_term=lambda ctx: None)  # a client's own term computed one client at a time only
    assert "own term has no stacked form" in (capture_refusal(own, mlp) or "")
    stacked_own = BatchedStep(client_term=lambda ctx: None, client_term_stacked=True, decay=lambda n: 0.1)  # GPFL's
    assert capture_refusal(stacked_own, mlp) is None
    assert "no stacked form" in (capture_refusal(stacked_own, res) or "")
    assert "inner steps" in (capture_refusal(replace(stacked_own, inner=InnerStep(2, None, False, 0.0)), mlp) or "")
    assert capture_refusal(BatchedStep(term=lambda ctx: None, term_padded=True), mlp) is None  # FedDecorr's
    inner = BatchedStep(inner=InnerStep(2, None, False, 0.0))
    assert capture_refusal(inner, mlp) is None  # Per-FedAvg's
    for beside in (replace(inner, sam_rho=0.1), replace(inner, logits=lambda ctx, c: None)):
        assert "inner steps" in (capture_refusal(beside, mlp) or "")
    sim = digits_simulation("fedavg", model="resnet8")  # a model without a stacked form
    with pytest.raises(ValueError, match="cannot run method 'fedavg' at one shape: the model has no stacked form"):
        train_batched(sim, 1, [0, 1], {c: sim.params_for(c) for c in (0, 1)}, {}, capture=True)
    sam_beside = BatchedStep(sam_rho=0.1, side_head=lambda ctx: None)  # type: ignore[arg-type,return-value]
    assert "SAM's second pass" in (capture_refusal(sam_beside, mlp) or "")


def test_a_client_term_declared_stacked_without_its_stacked_form_is_refused_by_name(monkeypatch):
    """A form that says ``client_term_stacked`` but returns a ``ClientTerm`` without ``stacked``: the padded steps
    refuse it rather than train without the term."""
    from fedskew.catalog import gpfl

    sim = digits_simulation("gpfl")
    monkeypatch.setattr(gpfl, "stacked_global_path", lambda lam: None)
    with pytest.raises(ValueError, match=r"declares a stacked client term .* has no stacked form \(stacked=None\)"):
        train_batched(sim, 1, [0, 1], {c: sim.params_for(c) for c in (0, 1)}, {}, capture=True)


def test_a_per_sample_term_that_gives_one_value_per_client_is_refused_by_name():
    """A form that says ``term_per_sample`` but returns ``[K]``: its batch mean would include the padding, so the
    padded step refuses it with the shapes rather than train on padding slots."""
    from fedskew.engine.stacked_step import stacked_step_function

    model = mlp_model()
    names = [n for n, _ in model.named_parameters()]
    step = stacked_step_function(model, names, 0.0, term=lambda feats, logits, y, outs: logits.sum((1, 2)))
    params = {n: p.detach().unsqueeze(0).repeat(2, *([1] * p.dim())) for n, p in model.named_parameters()}
    x, y = torch.randn(2, 3, 1, 8, 8), torch.zeros(2, 3, dtype=torch.long)
    padding = (torch.ones(2, 3), torch.full((2,), 3.0))
    with pytest.raises(ValueError, match=r"one value per sample \[2, 3\], got \[2\]"):
        step(params, {}, {}, x, y, rows=({}, None), padding=padding)
    step(params, {}, {}, x, y, rows=({}, None))  # unpadded (the bucketed loop): a value per client is the contract


@pytest.mark.parametrize("parts", [2, 3])
def test_an_inner_steps_slices_of_a_padded_batch_are_each_rows_own(parts):
    """Per-FedAvg's slices at padded shapes (``padded_cuts``): row ``r``'s slice ``i`` selects exactly
    ``split_batch(count_r, parts)[i]`` of its real samples, a slice past its batch's end the first one again (a batch
    of 1 or 2), none of a row without a batch."""
    from fedskew.client.batched_form import split_batch
    from fedskew.engine.batched_steps import padded_cuts

    b = 12
    count = torch.arange(b + 1)  # every real count from none to the full width
    cuts = padded_cuts(count, b, parts, torch.float32)
    for r, n in enumerate(count.tolist()):
        for i, (mask, counts) in enumerate(cuts):
            want = torch.zeros(b)
            if n > 0:
                want[split_batch(n, parts)[i]] = 1.0
            assert torch.equal(mask[r], want), (n, i)
            assert counts[r] == max(float(want.sum()), 1.0)
    assert split_batch(1, parts)[1] == slice(0, 1)  # the case a mask of the slice's own range would leave empty


def test_ladder_and_plan_cover_every_live_row():
    assert ladder(1) == [1] and ladder(5) == [5, 4, 3, 2, 1] and ladder(8) == [8, 6, 5, 4, 3, 2, 1]
    assert ladder(50) == [50, 36, 26, 19, 14, 10, 8, 6, 5, 4, 3, 2, 1]  # each about 1/√2 of the one before
    from fedskew.client.local import TrainSettings

    ns = [5, 23, 9, 40, 1]
    gens = [torch.Generator().manual_seed(i) for i in range(5)]
    offsets = np.concatenate([[0], np.cumsum(ns[:-1])]).tolist()
    sched = schedule(ns, offsets, TrainSettings(epochs=2, batch_size=8, lr=0.1), gens)
    plan = PaddedPlan(sched, 8, torch.device("cpu"))
    count, index = plan.count.numpy(), plan.index.numpy()
    assert list(sched.steps[plan.order]) == sorted(sched.steps, reverse=True)  # longest first: live rows a prefix
    for t, w in enumerate(plan.widths):
        live = int((sched.steps > t).sum())
        assert live <= w <= 1.5 * live  # the smallest ladder width covering them (within √2, rounded up)
        assert w == min(x for x in ladder(5) if x >= live)
        assert (count[t, :live] > 0).all() and (count[t, live:] == 0).all()
        for size, rows, idx in sched.at(t):  # each client's real samples, in its order, then padding
            for r, i in zip(rows, idx, strict=True):
                row = int(np.nonzero(plan.order == r)[0][0])
                assert count[t, row] == size and (index[t, row, :size] == i).all()
    assert count.sum() == sum(2 * n for n in ns)  # every sample of both epochs exactly once
    assert [w for w, _ in plan.shapes] == plan.widths
    for t, (_, b) in enumerate(plan.shapes):  # the step's batch width: the smallest of ladder(8) over its real batches
        assert b == min(x for x in ladder(8) if x >= count[t].max())


def test_steps_of_short_last_batches_alone_run_narrower():
    """The pfl-research shape: 45 samples each, batch 10: four full steps and one of 5 per client. The fifth step runs
    at batch width 5, not 10 (10% fewer padded samples), and the rows still train as the sequential loop does
    (tests above)."""
    from fedskew.client.local import TrainSettings
    from fedskew.engine.padded_plan import step_batches

    ns = [45] * 6
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    sched = schedule(ns, [45 * i for i in range(6)], TrainSettings(epochs=1, batch_size=10, lr=0.1), gens)
    plan = PaddedPlan(sched, 10, torch.device("cpu"))
    assert plan.shapes == [(6, 10)] * 4 + [(6, 5)]
    assert plan.count.numpy()[4].tolist() == [5] * 6
    assert step_batches(np.array([[7, 3], [3, 0], [1, 1]]), 10) == [8, 3, 1]  # ladder(10): 10, 8, 6, 5, 4, 3, 2, 1
    assert step_batches(np.zeros((0, 2), dtype=np.int64), 10) == []


def test_replay_runs_the_step_eagerly_off_a_cuda_device():
    calls = []
    replay = StepReplay(calls.append, torch.device("cpu"))
    for w in (4, 4, 2, 4):
        replay(w)
    assert calls == [4, 4, 2, 4] and not replay.capture and replay.graphs == {}


def test_runs_with_captured_steps_give_the_batched_records(tmp_path, monkeypatch):
    """``capture_steps`` end to end: a run and one experiment's seeds stacked (both through the padded steps) give the
    bucketed batched run's records; it needs ``batched_clients``; a BatchNorm model falls back with a warning."""
    from test_stacked_runs import BASE, _close

    import fedskew.engine.stacked_runs as stacked_runs
    from fedskew.config import make_config
    from fedskew.engine.captured import PaddedCache
    from fedskew.engine.stacked_runs import run_stacked
    from fedskew.runner import run_experiment

    seen = []
    original = stacked_runs.train_batched

    def spy(*args, **kwargs):
        seen.append(kwargs.get("capture"))
        return original(*args, **kwargs)

    monkeypatch.setattr(stacked_runs, "train_batched", spy)
    values = {**BASE, "method": "fedprox", "method_args": {"mu": 0.1}, "batched_clients": True}
    run_experiment(make_config(None, {**values, "seed": 0, "out": str(tmp_path / "buckets")}))
    run_experiment(make_config(None, {**values, "seed": 0, "capture_steps": True, "out": str(tmp_path / "one")}))
    _close(run_records(tmp_path / "buckets"), run_records(tmp_path / "one"))
    cfgs = [
        make_config(None, {**values, "seed": s, "capture_steps": True, "out": str(tmp_path / f"s{s}")}) for s in (0, 1)
    ]
    assert all(not isinstance(o, BaseException) for o in run_stacked(cfgs))
    _close(run_records(tmp_path / "buckets"), run_records(tmp_path / "s0"))
    # the stacked seeds' steps were padded too, every meeting with the rendezvous's one cache (its graphs replayed)
    assert len(seen) == BASE["rounds"] and all(isinstance(c, PaddedCache) for c in seen)
    assert len({id(c) for c in seen}) == 1 and len(seen[0].steps) >= 1
    with pytest.raises(ValueError, match="capture_steps .* needs batched_clients"):
        make_config(None, {**BASE, "capture_steps": True})
    res = {**values, "model": "resnet8", "rounds": 1, "capture_steps": True, "out": str(tmp_path / "res")}
    with pytest.warns(UserWarning, match="capture_steps: the model has no stacked form"):  # its steps in buckets
        run_experiment(make_config(None, res))


@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("scaffold", None),
        ("moon", {"mu": 1.0}),
        ("fedproto", {"lam": 1.0}),
        ("feddecorr", {"beta": 1e-3}),  # its PaddedTerm, one per beta
        ("fedgen", None),  # its head term, one per weight; the round's generator outside the graphs
        ("pfedme", {"inner_steps": 2}),  # θ's rows in the kept buffers
        ("gpfl", None),  # its stacked term, one per lam; the received embeddings' rows in the kept buffers
        ("fedcp", None),  # its MMD, one per lam; the heads' draws refilled at every step
    ],
)
def test_a_run_replays_its_buffers_round_after_round(one_thread, method, args):
    """A trainer's cache keeps one set of buffers (and, on a GPU, graphs) per shape of phase: the rounds that reuse
    them give bit for bit what fresh buffers give (momentum restarted, losses and rows replaced, MOON's frozen models
    and mask, FedProto's class sums), and a phase of another shape gets its own. MOON's term is one function for its
    hyper-parameters (``contrastive_term``), so its rounds share one shape too; FedProto's is a new function each
    round (its round's prototypes), whose shape replaces the last round's rather than piling up in the cache."""
    from fedskew.engine.captured import PaddedCache

    over = {"momentum": 0.9, "weight_decay": 1e-3, "local_epochs": 2}
    kept_sim, fresh_sim = (digits_simulation(method, args, rounds=3, **over) for _ in range(2))
    cache = PaddedCache()
    kept = set()  # the buffers each round ran in
    for rnd in (1, 2, 3):
        ups = []
        for sim, capture in ((kept_sim, cache), (fresh_sim, True)):
            plan = sim.open_round(rnd)
            cids = [c for c in plan.sampled if c not in plan.gone]
            ups.append(
                train_batched(sim, rnd, cids, {c: sim.params_for(c) for c in cids}, plan.broadcast, None, capture)
            )
            for u in ups[-1]:
                sim.take_upload(plan, u)
            sim.close_round(plan)
        for u, v in zip(*ups, strict=True):
            assert u.metrics == v.metrics
            assert all(torch.equal(u.params[k], v.params[k]) for k in u.params)
        kept |= {id(steps) for steps in cache.steps.values()}
    assert len(cache.steps) == 1  # every round had the same shape
    assert len(kept) == (3 if method == "fedproto" else 1)  # the same buffers (graphs) every round, but FedProto's
    if method != "scaffold":
        return
    ditto = digits_simulation("ditto", {"lam": 0.5})
    train_batched(ditto, 1, [0, 1, 2, 3], {c: ditto.params_for(c) for c in range(4)}, {}, None, cache)
    assert len(cache.steps) == 3  # Ditto's two phases (a proximal one and a plain one): two more shapes


class _FakeCuda:
    """The calls :class:`StepReplay` makes of ``torch.cuda``, recorded on a machine without CUDA: which stream is
    current when the step runs, the graphs captured and replayed, and a capture that fails on demand."""

    def __init__(self, fail_capture: bool = False) -> None:
        self.fail_capture, self.events, self.current, self.devices = fail_capture, [], "default", []
        fake = self

        class Stream:
            def __init__(self, device=None) -> None:
                self.name = "side"
                fake.events.append(("stream on", str(device)))

            def wait_stream(self, other) -> None:
                pass

        class Default:
            name = "default"

            def wait_stream(self, other) -> None:
                pass

        class Graph:
            def replay(self) -> None:
                fake.events.append(("replay", self.width))

        class Capture:
            def __init__(self, graph, pool=None, stream=None) -> None:
                self.graph, self.stream = graph, stream

            def __enter__(self):
                fake.current, fake.capturing = self.stream.name, self.graph
                return self

            def __exit__(self, kind, exc, tb) -> bool:
                fake.capturing = None
                if kind is not None:  # torch's graph: capture_end raises before the stream context is left
                    return False
                fake.current = "default"
                return False

        class StreamContext:
            def __init__(self, stream) -> None:
                self.stream = stream

            def __enter__(self):
                fake.current = self.stream.name

            def __exit__(self, *exc) -> None:
                fake.current = "default"

        class Device:
            def __init__(self, device) -> None:
                fake.devices.append(str(device))

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                pass

        self.capturing = None
        self.api = {
            "Stream": Stream,
            "CUDAGraph": Graph,
            "graph": Capture,
            "stream": StreamContext,
            "device": Device,
            "graph_pool_handle": lambda: "pool",
            "current_stream": lambda device=None: Default(),
            "set_stream": lambda stream: setattr(fake, "current", stream.name),
            "synchronize": lambda device=None: None,
        }

    def step(self, width: int) -> None:
        if self.capturing is not None:
            if self.fail_capture:
                raise RuntimeError("operation not permitted when stream is capturing")
            self.capturing.width = width
            self.events.append(("captured", width, self.current))
        else:
            self.events.append(("eager", width, self.current))


def test_replay_on_cuda_warms_up_captures_and_replays_each_width_on_the_runs_device(monkeypatch):
    """The control flow a CUDA device gets (the calls recorded, no GPU needed): per width, a first eager step on the
    side stream, then one capture on it (which runs nothing) and a replay, then replays only; all under the run's
    device (``cuda:1`` here), not the process's current one."""
    fake = _FakeCuda()
    for name, value in fake.api.items():
        monkeypatch.setattr(torch.cuda, name, value)
    replay = StepReplay(fake.step, torch.device("cuda:1"))
    for w in (4, 4, 4, 2, 2, 4):
        replay(w)
    assert fake.events == [
        ("stream on", "cuda:1"),
        ("eager", 4, "side"),  # the warm-up is a real step
        ("captured", 4, "side"),
        ("replay", 4),
        ("replay", 4),
        ("eager", 2, "side"),
        ("captured", 2, "side"),
        ("replay", 2),
        ("replay", 4),
    ]
    assert fake.devices == ["cuda:1"] * 6 and sorted(replay.graphs) == [2, 4] and fake.current == "default"


def test_a_failed_capture_puts_the_stream_back_and_goes_on_eagerly(monkeypatch):
    fake = _FakeCuda(fail_capture=True)
    for name, value in fake.api.items():
        monkeypatch.setattr(torch.cuda, name, value)
    replay = StepReplay(fake.step, torch.device("cuda"))
    with pytest.warns(UserWarning, match="capture failed .*stream is capturing.*running the steps eagerly"):
        for w in (3, 3, 3, 2):
            replay(w)
    # the failed capture's step runs again eagerly on the stream that was current, and every later step too
    assert fake.events[1:] == [
        ("eager", 3, "side"),
        ("eager", 3, "default"),
        ("eager", 3, "default"),
        ("eager", 2, "default"),
    ]
    assert not replay.capture and replay.graphs == {}
