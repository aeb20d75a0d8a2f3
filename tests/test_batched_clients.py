"""Batched clients (engine/batched.py) against the sequential loop: the same uploads, client states and rounds.

Each case runs two identical simulations side by side, one training its clients with ``Simulation._train`` (the one
sequential loop), the other with ``train_batched``; both go through the same open/take/close round machinery, so a
second round starts from the aggregated models (SCAFFOLD's c and c_i non-zero, FedPer's heads differing per client).
The tolerance is 1e-5 on every tensor; ``test_the_comparison_sees_a_different_batch_order`` shows it is tight enough
to catch a wrong batch order.
"""

from __future__ import annotations

import pytest
import torch
from conftest import digits_simulation

from fedskew.engine.batched import batchable, round_batched, train_batched
from fedskew.engine.rounds import sample_clients
from fedskew.methods import resolve_method
from fedskew.models import build_model

TOL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if a.is_floating_point():
        err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        assert err <= TOL, f"{what}: max difference {err:.3g}"
    else:  # num_batches_tracked: exactly the same count
        assert torch.equal(a, b), what


def _same_updates(seq, bat) -> None:
    assert [u.cid for u in seq] == [u.cid for u in bat]
    for u, v in zip(seq, bat, strict=True):
        assert u.num_samples == v.num_samples
        assert list(u.params) == list(v.params)  # state-dict order kept
        for k in u.params:
            _close(u.params[k], v.params[k], f"client {u.cid} {k}")
        assert sorted(u.extras) == sorted(v.extras)
        for k in u.extras:
            _close(u.extras[k], v.extras[k], f"client {u.cid} extra {k}")
        assert sorted(u.metrics) == sorted(v.metrics)
        assert u.metrics["steps"] == v.metrics["steps"]
        for k in u.metrics:  # relative above 1: a sum of many squared gradients (FedAS's Fisher trace, ~80)
            assert abs(u.metrics[k] - v.metrics[k]) <= TOL * max(1.0, abs(u.metrics[k])), (u.cid, k, u.metrics[k])


def _same_states(a, b) -> None:
    assert sorted(a) == sorted(b)
    for cid in a:
        assert sorted(a[cid]) == sorted(b[cid])
        for key, value in a[cid].items():
            if isinstance(value, dict):
                for k in value:
                    _close(value[k], b[cid][key][k], f"client {cid} state {key}/{k}")


# methods whose server amplifies float32 rounding: FedGen's server trains its generator for 1,000 Adam steps on the
# uploaded heads, and heads 6e-8 apart give generators several units apart (measured), so after round 1 the batched
# clients are compared on the sequential run's broadcast and received models instead of their own run's
SERVER_AMPLIFIES = ("fedgen",)


def _side_by_side(
    method: str, args: dict | None = None, rounds: int = 2, capture: bool = False, conv: str = "grouped", **over
):
    """Rounds of the sequential and the batched simulation; per round (received, broadcast, sequential, batched
    uploads). ``capture``: the batched steps at padded shapes (tests/test_captured_steps.py); ``conv``: the stacked
    convolutions' form (tests/test_stacked_conv.py)."""
    seq, bat = digits_simulation(method, args, rounds=rounds, **over), digits_simulation(method, args, rounds, **over)
    same_inputs = method.startswith(SERVER_AMPLIFIES)
    out = []
    for rnd in range(1, rounds + 1):
        plans = [sim.open_round(rnd) for sim in (seq, bat)]
        cids = [c for c in plans[0].sampled if c not in plans[0].gone]
        received = [{c: sim.params_for(c) for c in cids} for sim in (seq, bat)]
        sent = [{c: sim.sent_to(plan, c) for c in cids} for sim, plan in ((seq, plans[0]), (bat, plans[1]))]
        ups_seq = [seq._train(c, rnd, received[0][c], sent[0][c]) for c in cids]
        inputs = (received[0], plans[0].broadcast) if same_inputs else (received[1], plans[1].broadcast)
        own = sent[0] if same_inputs else sent[1]
        ups_bat = train_batched(bat, rnd, cids, *inputs, capture=capture, sent=own, conv=conv)
        for sim, plan, ups in ((seq, plans[0], ups_seq), (bat, plans[1], ups_bat)):
            for u in ups:
                sim.take_upload(plan, u)
            sim.close_round(plan)
        out.append((received[0], plans[0].broadcast, ups_seq, ups_bat))
    return seq, bat, out


def _trained_alike(seq, bat, rounds, moved_at_least: float = 1e-3) -> None:
    """Every round's uploads, the client states and the global models of :func:`_side_by_side`'s two runs agree, and
    the clients did train."""
    for received, _, ups_seq, ups_bat in rounds:
        _same_updates(ups_seq, ups_bat)
        for u in ups_seq:
            moved = max((u.params[k] - received[u.cid][k]).abs().max().item() for k in seq.trainable)
            assert moved > moved_at_least
    _same_states(seq.client_states, bat.client_states)
    for k in seq.global_params:
        _close(seq.global_params[k], bat.global_params[k], f"global {k}")


BN = {"model": "lenet_bn", "momentum": 0.9, "weight_decay": 1e-3, "lr": 0.01}


@pytest.mark.parametrize(
    ("method", "args", "over"),
    [
        ("fedavg", None, {}),
        ("fedprox", {"mu": 0.1}, {}),
        ("scaffold", None, {"momentum": 0.5}),
        ("fedavg+fedper", None, {}),
        ("fedavg", None, BN),
        ("fedavg", None, {**BN, "drop_last": True, "batch_size": 24}),
        ("fedprox+fedbn", {"mu": 0.01}, {**BN, "batch_size": 200}),  # a client with n < batch_size: one batch of n
        ("scaffold", None, {**BN, "batch_size": 32, "local_epochs": 2}),  # last batches mid-training
        ("fedavg+amp", None, {}),  # a personalized server: each client is sent its own model
        ("fedprox+qffl", None, {}),  # the loss-before wrapper: begin on the received model, metrics reported
        ("feddyn", {"alpha": 0.1, "clip": 0.5}, {}),  # a pull and g_k after the backward pass, clipping active
        # no clip, momentum and weight decay; lr 0.005: at 0.01 one client's 11th step in round 2 crosses a ReLU
        # boundary the sequential loop does not (1.6e-4 apart, while every step agrees to 2e-7: see docs/design.md)
        ("feddyn", {"clip": 0.0}, {**BN, "batch_size": 32, "lr": 0.005}),
        ("feddc", {"alpha": 0.1, "clip": 0.5}, {"momentum": 0.5}),  # drift pull, clip, and c/ω_i − c_i shift
        ("feddc+disco", {"correction": False}, {}),  # FedDisco's FedDC: no correction, no shift
        ("moon", None, {}),  # round 1: no previous model (plain CE); round 2: the contrastive term, projection head
        ("moon", {"mu": 5.0, "tau": 0.5, "projection": 0}, {**BN, "batch_size": 32}),  # BN: frozen copies in eval
        ("fedntd", {"beta": 2.0, "tau": 2.0}, {}),  # not-true distillation from the received model's logits
        ("fedntd+disco", None, {**BN, "batch_size": 32}),
        # phases: each its own schedule, optimizer (momentum restarts) and trained parameters
        ("ditto", {"lam": 0.5}, {"momentum": 0.5}),  # personal phase (proximal, from the kept model), global phase
        ("fedrep", {"head_epochs": 2}, {**BN, "batch_size": 32}),  # head only, then body only; the head stays local
        ("fedbabu", {"fine_tuning_epochs": 1}, {}),  # body phase (head frozen) kept as the upload, then fine-tuning
        ("fedbabu", {"fine_tuning_epochs": 1, "fine_tune_from": "global", "fine_tune": "head"}, {}),
        # FedALA: round 2 learns each client's ALA weights in begin (its own data and generator) and trains from
        # the blended start; the weights and the local top layers persist per client
        ("fedala", None, {}),
        ("fedala", {"layer_idx": 2, "rand_percent": 0.5}, {**BN, "batch_size": 32}),
        # FedGen: every step draws labels and noise from the client's generator (after its epoch's permutation),
        # generated features through the trained head; three epochs interleave permutations and draws
        # (100 generator steps a round on the server, not 1,000: the clients' training is what is compared). Three,
        # not two: at two epochs one client's round 2 sits where AVX-512's kernels (on one thread) move it by 8.1e-5
        # when its received model moves by one ulp, exactly the batched difference there (measured, 2026-12-04;
        # AVX2 2e-7); at three both agree to 1.2e-7, as FedProto below
        ("fedgen", {"server_epochs": 100}, {"local_epochs": 3}),
        ("fedgen", {"gen_batch_size": 7, "gen_weight": 0.5, "server_epochs": 100}, {**BN, "batch_size": 32}),
        # AFL with the loss after training, scored in end on each client's validation split
        ("fedavg+afl", {"loss": "after"}, {"validation": 0.2}),
        ("fedamp", None, {}),  # its own model persists (start), proximal towards the received cloud model
        ("fedcac", None, {}),  # critical masks uploaded, computed per client from the received and trained model
        ("fedavg+fedcac", {"tau": 0.3}, BN),
        # prototypes: round 1 plain CE, round 2 the prototype term; each client's last-epoch prototypes uploaded
        # (three epochs: at two, AVX-512's one-ulp floor in round 2 is 6.4e-5, as FedGen's above)
        ("fedproto", {"lam": 2.0}, {"local_epochs": 3}),
        ("fedproc", {"curriculum_rounds": 4}, {**BN, "batch_size": 32}),  # round 2: α = 2/3
        # each client's map of its logits before the loss, from its own label counts: a shift, a scale
        ("fedlc", {"tau": 0.5}, {"momentum": 0.5}),
        ("fedrs+disco", {"alpha": 0.3}, {**BN, "batch_size": 32}),
        # SAM: every step's gradient at w + ε (each client's own ε) on the same batch; BN statistics move once a step
        ("fedsam", {"rho": 0.1}, {"momentum": 0.5}),
        ("fedsam+disco", None, {**BN, "batch_size": 32}),
        # MoFedSAM: round 1 steps with α·g_SAM, round 2 mixes in the server's Δ
        ("mofedsam", {"alpha": 0.3}, {"weight_decay": 1e-3}),
        # FedRoD: BSM as each client's logit shift (−inf on its missing classes), the personal head trained beside
        # the model on its stacked rows by plain SGD (momentum and weight decay apply to the model only)
        ("fedrod", None, {"momentum": 0.5, "weight_decay": 1e-3}),
        ("fedrod", {"generic_loss": "ce"}, {**BN, "batch_size": 32}),
        # FedDBE: round 1 tracks each client's running mean (uploaded for ḡ); round 2 trains the representation bias
        # beside the model and pulls the running mean (momentum < 1: carried across steps) to ḡ
        ("feddbe", {"mean_momentum": 0.5, "kappa": 5.0}, {"momentum": 0.5}),
        ("feddbe", None, {**BN, "batch_size": 32}),
        # APFL: the mixed model's cross-entropy beside the model's; v by plain SGD, α by its adaptive rule (clipped)
        ("apfl", None, {"momentum": 0.5, "weight_decay": 1e-3}),
        ("apfl", {"adaptive": False, "alpha": 0.3}, {**BN, "batch_size": 32}),
        # Per-FedAvg: the gradient at the inner step's model on the second slice of each batch (last batches of 1
        # reuse the first slice); hf: the central difference on the third; BN moves once a step (the whole batch)
        ("perfedavg", None, {"momentum": 0.5}),
        ("perfedavg", {"variant": "hf", "alpha": 0.02}, {**BN, "batch_size": 33}),
        # pFedMe: θ solved by K inner steps on each batch (continued across steps), the model pulled towards it
        ("pfedme", {"lam": 5.0, "inner_steps": 3, "mu": 0.01}, {"momentum": 0.5}),
        # (BN at batch 32 is not used: its last-bit differences grow through the inner steps erratically, measured
        # 3e-5 at K=3, 2e-7 at K=4, 2.7e-4 at K=5; at batch 24 K=5 agrees to 2e-7 in both rounds)
        ("pfedme", None, {**BN, "batch_size": 24}),
        # FedAS: begin aligns the received body to the client's own prototypes (drawing from its shuffle stream
        # before the epochs' permutations), training starts from it, end sends the Fisher trace (round 2 aligns)
        ("fedas", None, {"momentum": 0.5}),
        ("fedas", {"first_align": True, "align_epochs": 2}, {**BN, "batch_size": 32}),
        # FedPAC: a head phase at its own rate, then the body with the prototype term from round 2 (begin's
        # statistics and end's prototypes per client)
        ("fedpac", {"head_lr": 0.05}, {"momentum": 0.5}),
        ("fedpac", {"lam": 2.0}, {**BN, "batch_size": 32}),
        # FedFomo: each client is sent its own peers (the server half's downloads), weighs them on its validation
        # split (begin) and trains from their combination; 3 rounds: round 3's peers are round 2's uploads
        ("fedfomo", {"peers": 2}, {"validation": 0.2, "rounds": 3}),
        ("fedfomo", {"anchor": "start", "epsilon": 0.3}, {**BN, "batch_size": 32, "validation": 0.2, "rounds": 3}),
        # GPFL: the global-feature path through each client's trained valve and embeddings, computed per client
        # under vmap (its composite head has no stacked form), and μ on their gradients after the backward pass
        ("gpfl", {"lam": 0.5}, {"momentum": 0.5}),
        ("gpfl", {"mu": 0.3}, {**BN, "batch_size": 32}),
        # FedCP: each client's Gumbel draws from its own stream in its step order, passed to its head's forward, and
        # the MMD to the received body's features computed per client under vmap
        ("fedcp", None, {"momentum": 0.5}),
        ("fedcp", {"lam": 1.0}, {**BN, "batch_size": 32}),
    ],
)
def test_batched_matches_sequential(one_thread, method, args, over):
    seq, bat, rounds = _side_by_side(method, args, **over)
    _trained_alike(seq, bat, rounds)
    # the cases exercise what they are named for
    steps = {u.metrics["steps"] for u in rounds[0][2]}
    assert len(steps) > 1  # clients of different sizes train different numbers of steps
    if method.startswith("scaffold"):
        assert any(t.abs().max() > 0 for t in rounds[1][1].values())  # c is non-zero in round 2
        assert all(any(t.abs().max() > 0 for t in s["scaffold_ci"].values()) for s in bat.client_states.values())
    if "fedper" in method or "fedbn" in method or "amp" in method:
        heads = [r["body.1.weight"] if "fedbn" in method else r["head.weight"] for r in rounds[1][0].values()]
        assert not torch.equal(heads[0], heads[1])  # what each client receives differs
    if over.get("model") == "lenet_bn":
        u = rounds[0][3][0]
        tracked = int(u.params["body.1.num_batches_tracked"])
        assert tracked > u.metrics["steps"] if method == "fedas" else tracked == u.metrics["steps"]  # + alignment
    if "afl" in method:
        assert all("loss_after" in u.metrics for u in rounds[0][3])
    if "qffl" in method:
        assert all("loss_before" in u.metrics for u in rounds[0][3])
    if method == "fedala":  # the weights were learned in round 2 and moved the start away from the received model
        assert all(u.metrics["ala_epochs"] > 0 for u in rounds[1][3])
        learned = [s["ala_weights"] for s in bat.client_states.values()]
        assert learned and all(any((w != 1).any() for w in ws.values()) for ws in learned)
    if method in ("ditto", "fedamp", "fedbabu"):  # the kept personal models equal the sequential ones (above)
        assert all("personal_model" in s for s in bat.client_states.values())
    if method == "feddyn":  # the linear term g_k is non-zero from round 2 on, in every client's state
        assert all(any(t.abs().max() > 0 for t in s["feddyn_grad"].values()) for s in bat.client_states.values())
    if method == "fedrod":  # each client's personal head was trained and kept, as the sequential loop keeps it
        assert all("fedrod_head" in st for st in bat.client_states.values())
    if method == "apfl":  # v and α trained and kept per client (α moved from its start when adaptive)
        alphas = [float(st["apfl_alpha"]["alpha"]) for st in bat.client_states.values()]
        assert alphas and (all(a != 0.5 for a in alphas) if not args else all(a == pytest.approx(0.3) for a in alphas))
    if method == "feddbe":  # round 1 uploaded the running means; round 2 trained each client's bias from ḡ
        assert all("feddbe_running_mean" in u.extras for u in rounds[0][3])
        assert "feddbe_global_mean" in rounds[1][1]
        assert all(st["feddbe_bias"]["bias"].abs().max() > 0 for st in bat.client_states.values())
    if method == "mofedsam":  # round 2 mixes in a non-zero direction
        assert any(t.abs().max() > 0 for k, t in rounds[1][1].items() if k.startswith("mofedsam_delta/"))
    if method == "fedas":  # the Fisher traces were sent and the own models kept; round 2 aligned before training
        assert all(u.metrics["fedas_fisher_trace"] > 0 for r in rounds for u in r[3])
        assert all("personal_model" in s for s in bat.client_states.values())
    if method == "fedpac":  # round 2 trained against the global prototypes the server broadcast
        assert "fedpac/protos" in rounds[1][1] and all("fedpac/v" in u.extras for u in rounds[1][3])
    if method == "fedfomo":  # from round 2 each client weighed peers of its own, and some trained from a mix
        ids = [u.extras["fomo_peer_ids"].tolist() for u in rounds[1][3]]
        assert ids and len({tuple(i) for i in ids}) > 1
    if method.startswith("feddc"):
        assert all(any(t.abs().max() > 0 for t in s["feddc_drift"].values()) for s in bat.client_states.values())
        if (args or {}).get("correction", True) is not False:
            assert any(t.abs().max() > 0 for t in rounds[1][1].values() if t.dim())  # c is non-zero in round 2


def test_moon_with_partial_participation_mixes_first_and_later_clients(one_thread):
    """join ratio 0.5 over 3 rounds: some rounds train clients with a previous model (the contrastive term) beside
    clients on their first participation (none); batched rounds give the sequential rounds' records and states."""
    over = {"join_ratio": 0.5, "rounds": 3}
    seq, bat = digits_simulation("moon", **over), digits_simulation("moon", **over)
    mixed = False
    for rnd in (1, 2, 3):
        before = {c for c, s in seq.client_states.items() if "moon_prev" in s}
        a, b = seq.round(rnd).record, round_batched(bat, rnd).record
        sampled = set(sample_clients(5, rnd, 4, 0.5))
        mixed |= bool(sampled & before) and bool(sampled - before)
        assert abs(a["train_loss"] - b["train_loss"]) <= TOL
        assert abs(a["global_acc"] - b["global_acc"]) <= 1e-9
    assert mixed  # the case the test is named for happened
    for k in seq.global_params:
        _close(seq.global_params[k], bat.global_params[k], f"global {k}")
    _same_states(seq.client_states, bat.client_states)


def test_moon_refuses_a_model_without_a_stacked_form():
    from fedskew.models import build_model

    method = resolve_method("moon", {"projection": 0})
    model = build_model("resnet8", in_channels=1, image_size=8, num_classes=10)
    reason = batchable(method, model)
    assert reason is not None and "Moon's loss term" in reason
    reason = batchable(resolve_method("fedgen", {}), model)
    assert reason is not None and "FedGen's loss term" in reason
    reason = batchable(resolve_method("fedrod", {}), model)
    assert reason is not None and "FedRoD's loss term" in reason  # its side head is written on the stacked graph
    assert batchable(resolve_method("fedavg", {}), model) is None  # vmap handles any model for the others


def test_batch_buckets_cover_last_batches():
    """The digits clients have last batches of several sizes at batch 24 (the buckets the equivalence relies on)."""
    sim = digits_simulation("fedavg")
    sizes = [c.x_train.shape[0] for c in sim.data.clients]
    assert len({n % 24 for n in sizes}) > 1 and len(set(sizes)) > 1


def test_round_batched_matches_round_with_partial_participation(one_thread):
    over = {"join_ratio": 0.5, "client_dropout": 0.2, "model": "lenet_bn", "momentum": 0.9, "lr": 0.01}
    seq, bat = digits_simulation("scaffold", rounds=3, **over), digits_simulation("scaffold", rounds=3, **over)
    for rnd in (1, 2, 3):
        a, b = seq.round(rnd).record, round_batched(bat, rnd).record
        assert a["participants"] == b["participants"] and a.get("dropped_out") == b.get("dropped_out")
        assert abs(a["train_loss"] - b["train_loss"]) <= TOL
        assert abs(a["global_acc"] - b["global_acc"]) <= 1e-9
    for k in seq.global_params:
        _close(seq.global_params[k], bat.global_params[k], f"global {k}")
    _same_states(seq.client_states, bat.client_states)
    for k in seq.server_half_state.c:
        _close(seq.server_half_state.c[k], bat.server_half_state.c[k], f"c {k}")


def test_groups_of_clients_give_the_same_uploads(one_thread):
    sims = [digits_simulation("fedavg", model="lenet_bn", batch_size=16) for _ in range(3)]
    cids = [0, 1, 2, 3]
    ups = []
    for sim, group in zip(sims, (None, 1, 3), strict=True):
        received = {c: sim.params_for(c) for c in cids}
        ups.append(train_batched(sim, 1, cids, received, {}, max_clients=group))
    _same_updates(ups[0], ups[1])
    _same_updates(ups[0], ups[2])
    with pytest.raises(ValueError, match="max_clients"):
        train_batched(sims[0], 1, cids, received, {}, max_clients=0)


def test_the_comparison_sees_a_different_batch_order(one_thread):
    """Batched training with the next round's generators (another batch order) is far outside the tolerance."""
    seq, bat = digits_simulation("fedavg"), digits_simulation("fedavg")
    received = {c: seq.params_for(c) for c in range(4)}
    a = [seq._train(c, 1, received[c], {}) for c in range(4)]
    b = train_batched(bat, 2, list(range(4)), received, {})
    with pytest.raises(AssertionError, match="max difference"):
        _same_updates(a, b)


@pytest.mark.parametrize(
    "method",
    [
        "fedavg",
        "fedprox",
        "scaffold",
        "fedavg+fedper",
        "fedprox+fedbn",
        "scaffold+heal",
        "fedavg+disco",
        "fedavg+fedsa",
        "fedavg+local",
        "fedprox+afl",
        "feddyn",
        "feddc+disco",
        "feddyn+heal",
        "moon",
        "moon+heal",
        "fedntd",
        "fedcac",
        "ditto",
        "fedrep",
        "fedbabu",
        "fedala",
        "fedala+disco",
        "fedgen",
        "moon+afl",
        "fedamp",
        "fedproto",
        "fedproc",
        "fedlc",
        "fedrs+fedadam",
        "fedsam",
        "mofedsam+heal",
        "fedrod",
        "feddbe",
        "apfl",
        "perfedavg",
        "pfedme",
    ],
)
def test_batchable_methods(method):
    assert batchable(resolve_method(method, {})) is None


def test_batchable_refuses_a_client_part_it_has_no_step_for():
    """A user's own client part (here a subclass of FedProx with its own loss) has no batched step: refused, naming
    it and the hook it overrides, and the engine trains it sequentially."""
    import dataclasses

    from fedskew.catalog.fedprox import FedProx

    @dataclasses.dataclass
    class Mine(FedProx):
        def loss(self, ctx, logits, features, y, x):
            return super().loss(ctx, logits, features, y, x) * 2

    method = dataclasses.replace(resolve_method("fedprox", {}), client=Mine())
    reason = batchable(method)
    assert reason is not None and "its client part Mine overrides loss below FedProx" in reason


def test_batchable_refuses_random_and_cumulative_models():
    method = resolve_method("fedavg", {})
    model = build_model("lenet_bn", in_channels=1, image_size=8, num_classes=10)
    assert batchable(method, model) is None
    model.body[1].momentum = None
    assert "cumulative average" in batchable(method, model)
    model = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    model.body.insert(2, torch.nn.Dropout(0.5))
    assert "Dropout" in batchable(method, model)


def test_train_batched_refuses_an_unbatchable_method():
    sim = digits_simulation("fedgen", model="resnet8")
    with pytest.raises(ValueError, match="cannot be trained with batched clients: FedGen's loss term"):
        train_batched(sim, 1, [0], {0: sim.params_for(0)}, {})


def test_the_vmap_path_trains_in_training_mode_after_an_evaluation(one_thread, monkeypatch):
    """A model without a stacked form trains through vmap's functional_call, which runs the modules in their current
    mode; the model comes to round 2 from round 1's evaluation in eval mode, where BatchNorm would normalize by its
    running statistics (found 2026-12-04: a ResNet's round 2 differed from the sequential loop by 0.3)."""
    import fedskew.engine.step_functions as step_functions

    monkeypatch.setattr(step_functions, "stackable", lambda module: "forced through vmap for this test")
    seq, bat, rounds = _side_by_side("fedavg", None, **{**BN, "batch_size": 32})
    assert not bat.model.training  # round 2's evaluation left it in eval mode, as it found it before round 2
    for _, _, ups_seq, ups_bat in rounds:
        _same_updates(ups_seq, ups_bat)


def test_batched_runs_are_reproducible(one_thread):
    """Two batched runs of the same round give bit-identical uploads (no hidden randomness)."""
    ups = []
    for _ in range(2):
        sim = digits_simulation("fedprox", model="lenet_bn", momentum=0.9)
        ups.append(train_batched(sim, 1, [0, 1, 2, 3], {c: sim.params_for(c) for c in range(4)}, {}))
    for u, v in zip(*ups, strict=True):
        assert all(torch.equal(u.params[k], v.params[k]) for k in u.params)
        assert u.metrics == v.metrics


@pytest.mark.parametrize(
    "method",
    [
        *("feddyn+disco", "feddc", "fedala", "fedgen", "fedrod", "feddbe", "apfl", "pfedme"),
        *("fedas", "fedpac", "fedfomo", "gpfl", "fedcp"),
    ],
)
def test_batched_drift_hosts_resume_exactly_with_drops(tmp_path, one_thread, method):
    """The client parts with state across rounds batched (FedDyn, FedDC, FedALA, FedGen, the personalized ones), with
    partial participation, drop-outs and ``on_bad_update: drop``:
    interrupted after round 2 and resumed gives the uninterrupted batched run's records, and both follow the
    sequential run (FedGen's only in round 1: its server amplifies rounding, see SERVER_AMPLIFIES)."""
    import json

    from fedskew.config import make_config
    from fedskew.protocol import TIMING_KEYS
    from fedskew.runner import run_experiment

    base = {"clients": 6, "rounds": 4, "method": method, "db": None, "seed": 4, "skew_probes": 0}
    base |= {"join_ratio": 0.67, "client_dropout": 0.2, "on_bad_update": "drop", "batched_clients": True}
    if method == "fedgen":  # 100 generator steps a round on the server, not 1,000 (its state resumes the same)
        base["method_args"] = {"server_epochs": 100}
    if method == "fedfomo":  # its peers are weighed on a validation split
        base["validation"] = 0.2

    def records(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]

    class Stop(Exception):
        pass

    def stop_after_two(result):
        if result.record["round"] == 2:
            raise Stop

    run_experiment(make_config(None, {**base, "out": str(tmp_path / "whole")}))
    cfg = make_config(None, {**base, "out": str(tmp_path / "cut"), "checkpoint_every": 1})
    with pytest.raises(Stop):
        run_experiment(cfg, on_round=stop_after_two)
    run_experiment(cfg, resume=True)
    assert records(tmp_path / "cut") == records(tmp_path / "whole")
    seq = records(tmp_path / "whole")
    run_experiment(make_config(None, {**base, "out": str(tmp_path / "seq"), "batched_clients": False}))
    compared = 1 if method.startswith(SERVER_AMPLIFIES) else len(seq)
    for a, b in zip(records(tmp_path / "seq")[:compared], seq[:compared], strict=True):
        assert a["participants"] == b["participants"] and a.get("dropped_out") == b.get("dropped_out")
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)


def test_a_phase_with_its_own_lr_trains_at_it_batched_as_sequentially(one_thread, monkeypatch):
    """``Phase.lr`` (FedPAC's ``head_lr``): the batched engine steps the phase at its own rate, as ``local_train``."""
    from fedskew.catalog.fedrep import FedRep
    from fedskew.client.kernels import is_head
    from fedskew.client.local import Phase

    def phases(self, ctx):
        return [
            Phase(self.head_epochs, name="head", trains=is_head, lr=0.2),
            Phase(ctx.settings.epochs, name="body", trains=lambda n: not is_head(n)),
        ]

    _, _, plain = _side_by_side("fedrep", {"head_epochs": 2}, rounds=1, **BN, batch_size=32)
    monkeypatch.setattr(FedRep, "phases", phases)
    _, _, own = _side_by_side("fedrep", {"head_epochs": 2}, rounds=1, **BN, batch_size=32)
    _same_updates(own[0][2], own[0][3])  # batched = sequential at the phase's lr
    pairs = zip(own[0][2], plain[0][2], strict=True)
    moved = [(o.params["head.weight"] - p.params["head.weight"]).abs().max().item() for o, p in pairs]
    assert min(moved) > 1e-3  # and that lr is not the run's
