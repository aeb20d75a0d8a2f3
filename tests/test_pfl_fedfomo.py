"""FedFomo (issue 42): the first-order weights and their combination by hand, the peer ranking with ε-greedy
exploration, the server half's affinities and downloads, and the per-client downloads through the engine."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedskew.catalog.fedfomo import (
    PEER_IDS,
    PEER_PREFIX,
    PEER_WEIGHTS,
    FedFomo,
    FomoServer,
    FomoState,
    combination,
    fomo_weights,
    ranked_peers,
)
from fedskew.client.local import LocalContext, TrainSettings, local_train, snapshot
from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.engine.loop import Simulation
from fedskew.engine.rounds import payload_bytes
from fedskew.models import FedModel
from fedskew.protocol import RoundInput

D, C = 4, 3


def _close(a, b, tol=1e-6):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert torch.allclose(a, b, atol=tol, rtol=0), (a, b)


def test_weights_are_the_loss_gain_per_distance_and_only_positive_ones_combine():
    f64 = torch.float64
    w = fomo_weights(1.0, torch.tensor([0.5, 1.5, 0.8], dtype=f64), torch.tensor([2.0, 1.0, 0.0], dtype=f64))
    _close(w, [0.5 / (2 + 1e-5), -0.5 / (1 + 1e-5), 0.2 / 1e-5])
    mix = combination(torch.tensor([0.25, -1.0, 0.75], dtype=torch.float64))
    _close(mix, [0.25, 0.0, 0.75])
    assert combination(torch.tensor([-0.1, 0.0], dtype=torch.float64)) is None  # keep the own model


def test_peers_are_ranked_by_affinity_self_first_then_explored():
    stored = frozenset({0, 1, 2, 3, 4})
    rng = np.random.default_rng(0)
    assert ranked_peers({3: 2.0, 1: 0.5, 4: -1.0}, 2, stored, 3, 0.0, rng) == [3, 2, 1]  # 2's own entry is 1
    assert ranked_peers({}, 2, frozenset({1}), 5, 0.0, rng) == [1]  # no more than the stored models
    assert ranked_peers({}, 2, frozenset(), 5, 0.0, rng) == []
    ties = {tuple(ranked_peers({}, 0, stored, 3, 0.0, np.random.default_rng(s))[1:]) for s in range(20)}
    assert len(ties) > 1  # equal affinities in a seeded random order
    assert all(ranked_peers({}, 0, stored, 3, 0.0, np.random.default_rng(s))[0] == 0 for s in range(20))
    explored = [ranked_peers({1: 9.0}, 0, stored, 1, 1.0, np.random.default_rng(s))[0] for s in range(40)]
    assert set(explored) == set(stored)  # ε = 1: any client; never the same one twice in a download
    assert all(len(set(ranked_peers({}, 0, stored, 5, 1.0, np.random.default_rng(s)))) == 5 for s in range(10))


def _rin(cids, extras):
    k = len(cids)
    return RoundInput(
        round=1,
        cids=tuple(cids),
        params={"w": torch.zeros(k, 2)},
        num_samples=torch.ones(k, dtype=torch.float64),
        extras=extras,
        global_params={"w": torch.zeros(2)},
        trainable=frozenset({"w"}),
    )


def test_server_half_adds_the_uploaded_weights_to_p_and_sends_the_ranked_peers_models():
    half = FomoServer(peers=2)
    state = FomoState({}, frozenset(), 0, ("w",))
    state = half.advance(_rin([0, 1, 2], {}), state)
    assert state.stored == {0, 1, 2} and state.affinity == {}
    ids = torch.tensor([[1, 2], [0, 1], [2, 0]])
    w = torch.tensor([[0.5, -0.25], [3.0, 0.0], [0.0, 0.1]], dtype=torch.float64)
    state = half.advance(_rin([0, 1, 2], {PEER_IDS: ids, PEER_WEIGHTS: w}), state)
    state = half.advance(_rin([0], {PEER_IDS: ids[:1], PEER_WEIGHTS: w[:1]}), state)
    assert state.affinity[0] == {1: 1.0, 2: -0.5} and state.affinity[1] == {0: 3.0, 1: 0.0}
    models = {j: {"w": torch.full((2,), float(j))} for j in range(3)}
    sent = half.downloads(state, 0, 3, models.get)
    # scores: own 1, client 1: 0.5 + 0.5, client 2: −0.25 − 0.25; the tie of 0 and 1 in a seeded order
    ids = sent[PEER_IDS].tolist()
    assert sorted(ids) == [0, 1]
    assert sent[PEER_PREFIX + "w"].tolist() == [[float(j)] * 2 for j in ids]
    assert half.downloads(state, 0, 3, models.get)[PEER_IDS].tolist() == ids  # the same draw again
    assert half.downloads(FomoState({}, frozenset(), 0, ("w",)), 0, 1, models.get) == {}
    with pytest.raises(RuntimeError, match="holds no model"):
        half.downloads(state, 0, 3, lambda j: None)


def _model(seed=1):
    torch.manual_seed(seed)
    return FedModel(nn.Flatten(), nn.Linear(D, C))


def test_client_combines_its_peers_by_their_validation_gain_then_trains_from_the_combination():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, D, generator=g), torch.tensor([0, 1, 2, 0, 1, 2])
    xv, yv = torch.randn(5, D, generator=g), torch.tensor([0, 1, 2, 2, 1])
    model = _model()
    own = snapshot(model)
    peers = [{k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in own.items()} for _ in range(3)]
    broadcast = {PEER_IDS: torch.tensor([4, 0, 7])}
    broadcast |= {PEER_PREFIX + n: torch.stack([p[n] for p in peers]) for n in own}
    settings = TrainSettings(epochs=1, batch_size=6, lr=0.1)
    ctx = LocalContext(0, 2, model, own, {}, broadcast, settings, x_val=xv, y_val=yv)
    up = local_train(FedFomo(), ctx, x, y, torch.Generator().manual_seed(3))

    def val_loss(p):
        return float(F.cross_entropy(xv @ p["head.weight"].T + p["head.bias"], yv))

    dist = [sum(float(((p[n] - own[n]) ** 2).sum()) for n in own) ** 0.5 for p in peers]
    expected = [(val_loss(own) - val_loss(p)) / (d + 1e-5) for p, d in zip(peers, dist, strict=True)]
    _close(up.extras[PEER_WEIGHTS], expected)
    assert up.extras[PEER_IDS].tolist() == [4, 0, 7]
    pos = [max(e, 0.0) for e in expected]
    assert sum(pos) > 0
    start = {n: sum(pw / sum(pos) * p[n] for pw, p in zip(pos, peers, strict=True)) for n in own}
    # one full-batch step of plain SGD from the combination
    wgt = start["head.weight"].clone().requires_grad_(True)
    bias = start["head.bias"].clone().requires_grad_(True)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(3))
    F.cross_entropy(x[perm] @ wgt.T + bias, y[perm]).backward()
    _close(up.params["head.weight"], start["head.weight"] - 0.1 * wgt.grad, 1e-5)
    _close(up.params["head.bias"], start["head.bias"] - 0.1 * bias.grad, 1e-5)


def test_without_downloads_or_a_positive_weight_the_client_trains_its_own_model():
    x, y = torch.randn(4, D), torch.tensor([0, 1, 2, 0])
    model = _model()
    own = snapshot(model)
    settings = TrainSettings(epochs=1, batch_size=4, lr=0.0)  # lr 0: the upload is the start
    ctx = LocalContext(0, 1, model, own, {}, {}, settings, x_val=x, y_val=y)
    up = local_train(FedFomo(), ctx, x, y, torch.Generator().manual_seed(0))
    assert up.extras == {} and all(torch.equal(up.params[n], own[n]) for n in own)
    # a peer far worse on a validation split of class 0 only: it all but rules class 0 out
    worse = {**own, "head.bias": own["head.bias"] - torch.tensor([50.0, 0.0, 0.0])}
    broadcast = {PEER_IDS: torch.tensor([1]), **{PEER_PREFIX + n: v[None] for n, v in worse.items()}}
    ctx = LocalContext(0, 2, _model(), own, {}, broadcast, settings, x_val=x, y_val=torch.zeros(4, dtype=torch.long))
    up = local_train(FedFomo(), ctx, x, y, torch.Generator().manual_seed(0))
    assert float(up.extras[PEER_WEIGHTS][0]) < 0 and all(torch.equal(up.params[n], own[n]) for n in own)


def _sim(**over):
    values = {"clients": 5, "rounds": 3, "method": "fedfomo", "db": None, "skew_probes": 0, "seed": 5}
    cfg = make_config(None, {**values, "validation": 0.2, **over})
    return Simulation(cfg, build_federated(cfg))


def test_in_the_engine_each_client_downloads_its_peers_and_the_bytes_count_them():
    sim = _sim(method_args={"peers": 2})
    first = sim.round(1).record
    assert sim.server.server_half_state.stored == set(range(5))
    models = sum(sim.server.wire_bytes(sim.server.received(c)) for c in range(5))
    second = sim.round(2).record
    one = payload_bytes(sim.method.server_half.downloads(sim.server.server_half_state, 0, 2, sim.server.personal.get))
    assert first["bytes_down"] < second["bytes_down"]
    assert second["bytes_down"] == models + 5 * one  # its model, and 2 peer models with their ids, each
    for c in range(5):  # each client's model on the server is its upload: the personal view scores it
        assert all(torch.equal(sim.personal_params(c)[n], sim.trained_params(c)[n]) for n in sim.global_params)
    affinity = sim.server.server_half_state.affinity
    assert set(affinity) == set(range(5)) and all(len(row) <= 2 for row in affinity.values())


def test_fedfomo_needs_a_validation_split_and_anchor_start_keeps_the_start_model():
    with pytest.raises(Exception, match="FedFomo"):
        make_config(None, {"method": "fedfomo", "clients": 4})
    sim = _sim(method_args={"anchor": "start"})
    sim.round(1)
    sim.round(2)
    assert all("fedfomo_start" in sim.client_states[c] for c in range(5))


def test_batched_clients_get_their_own_downloads_and_give_the_sequential_run():
    """With ``batched_clients`` each client is sent its own peers (the round server's ``sent_to``), as in the
    sequential loop: the same records and personal models; batched training without them is refused by name."""
    from fedskew.engine.batched import train_batched

    seq, bat = _sim(method_args={"peers": 2}), _sim(method_args={"peers": 2}, batched_clients=True)
    assert bat._batched is not None  # trained batched, not fallen back to the sequential loop
    for rnd in (1, 2, 3):
        a, b = seq.round(rnd).record, bat.round(rnd).record
        assert a["bytes_down"] == b["bytes_down"]
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-5
    for c in range(5):
        for n, t in seq.personal_params(c).items():
            assert (t.double() - bat.personal_params(c)[n].double()).abs().max() <= 1e-5, (c, n)
    with pytest.raises(ValueError, match="downloads"):
        train_batched(bat, 4, [0, 1], {c: bat.params_for(c) for c in (0, 1)}, {})
    with pytest.raises(ValueError, match=r"sent has nothing for client\(s\) \[1\]"):
        train_batched(bat, 4, [0, 1], {c: bat.params_for(c) for c in (0, 1)}, {}, sent={0: {}})


def test_fomo_weights_are_on_the_distances_device():
    # the peers' losses are host numbers, the distances the models' own: on a GPU they met on two devices (the meta
    # device stands in for a second one on a CPU-only machine)
    w = fomo_weights(1.0, torch.tensor([0.5, 2.0], dtype=torch.float64), torch.ones(2, device="meta"))
    assert w.device.type == "meta" and w.dtype == torch.float64
