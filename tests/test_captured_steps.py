"""Batched steps at one shape (engine/captured.py) against the sequential loop, and the refusals.

On a CPU the padded, masked steps run eagerly: the same computation a CUDA device captures once per width and
replays. Each case trains two identical simulations side by side, one client after the other and batched with
``capture=True``, over two rounds (the second from the aggregated models), at the batched path's tolerance (1e-5).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import digits_simulation
from test_batched_clients import _close, _same_states, _same_updates, _side_by_side

from fedskew.client.batched_form import BatchedStep
from fedskew.engine.batched import train_batched
from fedskew.engine.batched_schedule import schedule
from fedskew.engine.captured import PaddedPlan, StepReplay, capture_refusal, ladder
from fedskew.models import build_model


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
    over = {"momentum": 0.9, "weight_decay": 1e-2, "batch_size": 16}
    sims = [digits_simulation("fedprox", {"mu": 0.5}, **over) for _ in range(2)]
    cids = [0, 1, 2, 3]
    sizes = [c.x_train.shape[0] for c in sims[0].data.clients]
    short = int(np.argmin(sizes))
    group = train_batched(sims[0], 1, cids, {c: sims[0].params_for(c) for c in cids}, {}, capture=True)
    alone = train_batched(sims[1], 1, [short], {short: sims[1].params_for(short)}, {}, capture=True)
    for k, v in alone[0].params.items():
        assert torch.equal(group[short].params[k], v), k


def test_refusals_name_what_cannot_be_padded():
    rule = BatchedStep()
    assert capture_refusal(rule, build_model("mlp", in_channels=1, image_size=8, num_classes=10)) is None
    bn = build_model("lenet_bn", in_channels=1, image_size=8, num_classes=10)
    assert "BatchNorm" in (capture_refusal(rule, bn) or "")
    res = build_model("resnet8", in_channels=1, image_size=8, num_classes=10)
    assert "no stacked form" in (capture_refusal(rule, res) or "")
    term = BatchedStep(term=lambda ctx: None)
    assert "loss term" in (capture_refusal(term, build_model("mlp", in_channels=1, image_size=8, num_classes=10)) or "")
    sim = digits_simulation("moon")
    with pytest.raises(ValueError, match="one shape: the client part's loss term"):
        train_batched(sim, 1, [0, 1], {c: sim.params_for(c) for c in (0, 1)}, {}, capture=True)


def test_ladder_and_plan_cover_every_live_row():
    assert ladder(1) == [1] and ladder(5) == [5, 3, 2, 1] and ladder(8) == [8, 4, 2, 1]
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
        assert live <= w < 2 * live or w == live  # the smallest ladder width covering them
        assert (count[t, :live] > 0).all() and (count[t, live:] == 0).all()
        for size, rows, idx in sched.at(t):  # each client's real samples, in its order, then padding
            for r, i in zip(rows, idx, strict=True):
                row = int(np.nonzero(plan.order == r)[0][0])
                assert count[t, row] == size and (index[t, row, :size] == i).all()
    assert count.sum() == sum(2 * n for n in ns)  # every sample of both epochs exactly once


def test_replay_runs_the_step_eagerly_off_a_cuda_device():
    calls = []
    replay = StepReplay(calls.append, torch.device("cpu"))
    for w in (4, 4, 2, 4):
        replay(w)
    assert calls == [4, 4, 2, 4] and not replay.capture and replay.graphs == {}


def test_runs_with_captured_steps_give_the_batched_records(tmp_path, monkeypatch):
    """``capture_steps`` end to end: a run and one experiment's seeds stacked (both through the padded steps) give the
    bucketed batched run's records; it needs ``batched_clients``; a BatchNorm model falls back with a warning."""
    from test_stacked_runs import BASE, _close, _records

    import fedskew.engine.stacked_runs as stacked_runs
    from fedskew.config import make_config
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
    _close(_records(tmp_path / "buckets"), _records(tmp_path / "one"))
    cfgs = [
        make_config(None, {**values, "seed": s, "capture_steps": True, "out": str(tmp_path / f"s{s}")}) for s in (0, 1)
    ]
    assert all(not isinstance(o, BaseException) for o in run_stacked(cfgs))
    _close(_records(tmp_path / "buckets"), _records(tmp_path / "s0"))
    assert seen == [True] * BASE["rounds"]  # the stacked seeds' steps were padded too
    with pytest.raises(ValueError, match="capture_steps .* needs batched_clients"):
        make_config(None, {**BASE, "capture_steps": True})
    bn = {**values, "model": "lenet_bn", "rounds": 1, "capture_steps": True, "out": str(tmp_path / "bn")}
    with pytest.warns(UserWarning, match="capture_steps: the model has buffers"):
        run_experiment(make_config(None, bn))


def test_a_run_replays_its_buffers_round_after_round(one_thread):
    """A trainer's cache keeps one set of buffers (and, on a GPU, graphs) per shape of phase: the rounds that reuse
    them give bit for bit what fresh buffers give (momentum restarted, losses and rows replaced), and a phase of
    another shape gets its own."""
    from fedskew.engine.captured import PaddedCache

    over = {"momentum": 0.9, "weight_decay": 1e-3, "local_epochs": 2}
    kept_sim, fresh_sim = (digits_simulation("scaffold", rounds=3, **over) for _ in range(2))
    cache = PaddedCache()
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
    assert len(cache.steps) == 1  # every round had the same shape
    ditto = digits_simulation("ditto", {"lam": 0.5})
    train_batched(ditto, 1, [0, 1, 2, 3], {c: ditto.params_for(c) for c in range(4)}, {}, None, cache)
    assert len(cache.steps) == 3  # Ditto's two phases (a proximal one and a plain one): two more shapes
