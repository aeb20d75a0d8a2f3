"""Personalized methods on the one loop: phases, client-local groups, personal views, FedAMP, uploads' bytes."""

import json
import math

import numpy as np
import pytest
import torch

from fedskew.catalog.ditto import Ditto
from fedskew.catalog.fedamp import FedAMP, amp_mixing, squared_distances
from fedskew.client.kernels import PERSONAL, is_head
from fedskew.client.local import (
    LocalAlgorithm,
    LocalContext,
    Phase,
    StateKey,
    TrainSettings,
    local_train,
    snapshot,
)
from fedskew.config import ConfigError, make_config
from fedskew.data.federated import build_federated
from fedskew.engine.loop import Simulation, payload_bytes
from fedskew.methods import resolve_method
from fedskew.models import build_model
from fedskew.protocol import TIMING_KEYS, Upload
from fedskew.runner import run_experiment
from fedskew.server.uploads import stack_uploads
from fedskew.server.weights import SampleWeights, UniformWeights


def _sim(method: str, **over) -> Simulation:
    cfg = make_config(
        None, {"clients": 4, "rounds": 2, "method": method, "db": None, "skew_probes": 0, "seed": 5, **over}
    )
    return Simulation(cfg, build_federated(cfg))


def _ctx(model, settings, state=None):
    return LocalContext(0, 1, model, snapshot(model), state if state is not None else {}, {}, settings)


def _data(n=40):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


# ---- phases on the one loop ----------------------------------------------------------------------------------------


AFTER_HEAD = StateKey[dict]("after_head", "the model after the head phase")


class HeadOnly(LocalAlgorithm):
    state_keys = (AFTER_HEAD,)

    def phases(self, ctx):
        return [Phase(2, name="head", trains=is_head, keep=AFTER_HEAD)]


def test_a_phase_trains_only_its_parameters_and_keeps_a_snapshot():
    model = build_model("mlp", in_channels=1, image_size=8, num_classes=3)
    ctx = _ctx(model, TrainSettings(epochs=1, batch_size=8, lr=0.5))
    before = snapshot(model)
    x, y = _data()
    up = local_train(HeadOnly(), ctx, x, y, torch.Generator().manual_seed(1))
    for k, v in up.params.items():
        assert torch.equal(v, before[k]) != is_head(k), k  # body frozen, head moved
    assert all(p.requires_grad for p in model.parameters())  # frozen parameters are restored
    assert all(torch.equal(ctx.client_state["after_head"][k], up.params[k]) for k in up.params)


def test_fedrep_trains_head_then_body_and_keeps_the_head_local():
    sim = _sim("fedrep", method_args={"head_epochs": 2})
    assert sim.method.name == "fedrep+fedper" and sim.method.personalized
    assert sim.local_names == {k for k in sim.global_params if k.startswith("head.")}
    rec = sim.round(1).record
    heads = [sim.client_states[c]["local_params"]["head.weight"] for c in range(4)]
    assert not torch.equal(heads[0], heads[1])  # every client has its own head
    assert torch.equal(sim.params_for(2)["head.weight"], heads[2])
    shared = {k: v for k, v in sim.global_params.items() if not k.startswith("head.")}
    assert rec["bytes_up"] == 4 * payload_bytes(shared)  # the head never travels
    assert rec["personal_acc_mean"] == rec["global_local_acc_mean"]  # global body + own head


def test_ditto_keeps_a_personal_model_pulled_towards_the_global_one():
    x, y = _data()
    settings = TrainSettings(epochs=2, batch_size=8, lr=0.1)
    drift = {}
    for lam in (0.0, 5.0):
        torch.manual_seed(0)
        model = build_model("mlp", in_channels=1, image_size=8, num_classes=3)
        received = snapshot(model)
        ctx = _ctx(model, settings)
        up = local_train(Ditto(lam=lam), ctx, x, y, torch.Generator().manual_seed(1))
        own = Ditto().personal_model(ctx.client_state)
        assert own is ctx.client_state[PERSONAL.name]
        drift[lam] = sum(float((own[k] - received[k]).norm()) for k in own if own[k].is_floating_point())
        assert any(not torch.equal(up.params[k], own[k]) for k in own)  # upload = global model, not personal
    assert drift[5.0] < 0.5 * drift[0.0]


def test_ditto_personal_view_is_the_kept_model():
    sim = _sim("ditto", rounds=1)
    sim.round(1)
    for c in range(4):
        assert sim.personal_params(c) is sim.client_states[c][PERSONAL.name]
        assert sim.trained_params(c) is sim.client_states[c][PERSONAL.name]


def test_local_never_communicates_and_each_client_keeps_its_own_model():
    sim = _sim("separate")
    assert sim.method.name == "local"
    rec = sim.round(1).record
    assert rec["bytes_up"] == rec["bytes_down"] == 0
    for c in range(4):
        own = sim.client_states[c]["local_params"]
        assert all(torch.equal(sim.personal_params(c)[k], own[k]) for k in own)
    assert rec["personal_acc_mean"] == rec["trained_acc_mean"]


def test_fedbn_keeps_norm_layers_local_and_refuses_models_without_them():
    sim = _sim("fedbn", model="resnet8", rounds=1, clients=3)
    assert sim.local_names and all(".bn" in k or "body.1." in k or "shortcut.1" in k for k in sim.local_names)
    sim.round(1)
    k = next(n for n in sim.local_names if n.endswith("running_mean"))
    assert not torch.equal(sim.params_for(0)[k], sim.params_for(1)[k])
    with pytest.raises(ValueError, match="no normalization layers"):
        _sim("fedbn", model="mlp")


def test_fedcac_round_uploads_masks_as_bits_and_records_both_views():
    sim = _sim("fedcac", rounds=1)
    rec = sim.round(1).record
    trainable = {k: v for k, v in sim.global_params.items() if k in sim.trainable}
    mask_bytes = sum(math.ceil(v.numel() / 8) for v in trainable.values())
    assert rec["bytes_up"] == 4 * (payload_bytes(sim.global_params) + mask_bytes)
    assert {"personal_acc_mean", "trained_acc_mean", "global_local_acc_mean"} <= set(rec)
    assert rec["diagnostics"]["cac_critical_frac"] == pytest.approx(0.5, abs=0.01)
    # after aggregation, each client holds its customized model: not its trained one, not the global one
    for c in range(4):
        p, t = sim.personal_params(c), sim.trained_params(c)
        assert any(not torch.equal(p[k], t[k]) for k in sim.trainable)
        assert any(not torch.equal(p[k], sim.global_params[k]) for k in sim.trainable)


def test_fedcac_bn_buffers_stay_with_each_client_through_the_engine():
    sim = _sim("fedcac", model="resnet8", rounds=1, clients=3)
    updates = {}
    sim.round(1)
    for c in range(3):
        updates[c] = sim.trained_params(c)
    for c in range(3):
        for k in sim.global_params:
            if k not in sim.trainable:
                assert torch.equal(sim.personal_params(c)[k], updates[c][k]), k


def test_fedcac_runs_are_reproducible(tmp_path):
    lines = []
    for i in range(2):
        cfg = make_config(
            None,
            {"method": "fedcac", "clients": 4, "rounds": 2, "seed": 3, "out": str(tmp_path / f"r{i}"), "db": None},
        )
        run_experiment(cfg)
        recs = [json.loads(x) for x in (tmp_path / f"r{i}" / "metrics.jsonl").read_text().splitlines()]
        lines.append([{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in recs])
    assert lines[0] == lines[1]
    summary = json.loads((tmp_path / "r0" / "summary.json").read_text())
    assert "personal_acc_mean" in summary and "trained_acc_mean" in summary


def test_partial_participation_absent_clients_keep_their_model():
    sim = _sim("fedcac", join_ratio=0.5, clients=6)
    sim.round(1)
    sim.round(2)
    trained_r2 = set(sim.personal)  # everyone who ever took part has a personalized model
    assert trained_r2 and len(trained_r2) <= 6
    before = {c: sim.personal[c] for c in sim.personal}
    from fedskew.engine.loop import sample_clients

    part = set(sample_clients(sim.cfg.seed, 3, 6, 0.5))
    sim.round(3)
    for c, params in before.items():
        if c not in part:
            assert sim.personal[c] is params


# ---- FedAMP ---------------------------------------------------------------------------------------------------------


def test_amp_mixing_literal_weights():
    d = torch.tensor([[0.0, 100.0, 200.0], [100.0, 0.0, 50.0], [200.0, 50.0, 0.0]], dtype=torch.float64)
    xi, rescaled = amp_mixing(d, alpha_k=10.0, sigma=100.0)
    e = lambda x: 10.0 * math.exp(-x / 100) / 100  # noqa: E731
    assert rescaled == 0
    assert float(xi[0, 1]) == pytest.approx(e(100)) and float(xi[1, 2]) == pytest.approx(e(50))
    assert float(xi[0, 0]) == pytest.approx(1 - e(100) - e(200))
    assert torch.allclose(xi.sum(1), torch.ones(3, dtype=torch.float64))


def test_amp_mixing_rescales_rows_that_would_extrapolate():
    d = torch.zeros(3, 3, dtype=torch.float64)  # identical models: literal weights alpha/sigma = 100 each
    xi, rescaled = amp_mixing(d, alpha_k=1e4, sigma=100.0)
    assert rescaled == 3
    assert (xi >= 0).all() and torch.allclose(xi.sum(1), torch.ones(3, dtype=torch.float64))
    assert torch.allclose(xi.diagonal(), torch.zeros(3, dtype=torch.float64))


def test_fedamp_server_builds_cloud_models_from_uploads():
    w = [torch.tensor([0.0, 0.0]), torch.tensor([3.0, 4.0]), torch.tensor([6.0, 8.0])]
    ups = [Upload(i, {"w": x, "b": torch.tensor([float(i)])}, 10) for i, x in enumerate(w)]
    rin = stack_uploads(
        ups,
        rnd=31,
        global_params={"w": torch.zeros(2), "b": torch.zeros(1)},
        trainable=frozenset({"w"}),
        label_hists=np.ones((3, 2)),
    )
    assert squared_distances(rin).tolist() == [[0, 25, 100], [25, 0, 25], [100, 25, 0]]
    amp = FedAMP(UniformWeights(), alpha_k=100.0, sigma=50.0, decay_rate=0.1, decay_every=30)
    out, _ = amp.aggregate(rin, amp.init(None))
    assert out.diagnostics["amp_alpha_k"] == pytest.approx(10.0)  # decayed once after 30 rounds
    xi, _ = amp_mixing(squared_distances(rin), 10.0, 50.0)
    for i in range(3):
        want = sum(float(xi[i, j]) * w[j] for j in range(3))
        assert torch.allclose(out.personal[i]["w"], want.float())
        assert torch.equal(out.personal[i]["b"], torch.tensor([float(i)]))  # buffers/untrainable: own


def test_fedamp_client_keeps_its_own_model_and_starts_from_it():
    sim = _sim("fedamp", rounds=2)
    assert sim.method.name == "fedamp+amp"
    sim.round(1)
    own = {c: sim.client_states[c][PERSONAL.name] for c in range(4)}
    for c in range(4):
        assert sim.personal_params(c) is own[c]
        assert any(not torch.equal(sim.params_for(c)[k], own[c][k]) for k in sim.trainable)  # u_i is only the anchor


# ---- composition rules ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, args, msg",
    [
        ("fedcac+fedsa", {}, "personalized server strategy"),
        ("fedcac+heal", {}, "takes no masking piece"),
        ("moon+fedcac", {"tau": 0.4}, "ambiguous here; use moon.tau or fedcac.tau"),
        ("moon+fedcac", {"fedsa.lam": 0.4}, "no hyper-parameter 'fedsa.lam'"),
        ("fedamp+fedcac", {}, "two plug-ins both set"),
        ("fedcac", {"tau": 1.5}, "tau"),
        ("ditto", {"lam": -1}, "lam"),
    ],
)
def test_meaningless_personalized_compositions_are_refused(name, args, msg):
    with pytest.raises(ConfigError, match=msg):
        resolve_method(name, args)


def test_a_key_two_parts_share_is_qualified_with_the_part():
    m = resolve_method("moon+fedcac", {"moon.tau": 0.7, "fedcac.tau": 0.3, "mu": 2.0})
    assert m.client.tau == 0.7 and m.upload_extras[0].tau == 0.3 and m.client.mu == 2.0
    assert m.args["moon.tau"] == 0.7 and m.args["fedcac.tau"] == 0.3 and m.args["mu"] == 2.0
    heal = resolve_method("moon+heal", {"heal.tau": 0.5})  # the brief's MOON + HEAL composition
    assert heal.server.masking.tau == 0.5 and heal.client.tau == 0.5


@pytest.mark.parametrize(
    "name", ["fedprox+fedcac", "fedprox+fedper", "ditto+fedbn", "fedcac+disco", "moon+local", "moon+fedcac"]
)
def test_valid_personalized_compositions_resolve(name):
    m = resolve_method(name, {})
    assert m.personalized


@pytest.mark.parametrize(
    "name, args, expected",
    [
        ("ditto", {}, UniformWeights),  # official Ditto code: plain mean of the participants' global models
        ("ditto", {"weights": "samples"}, SampleWeights),
        ("ditto+fedbn", {}, UniformWeights),
        ("fedrep", {}, SampleWeights),
        ("fedcac", {}, SampleWeights),
    ],
)
def test_ditto_server_averages_uniformly_by_default(name, args, expected):
    m = resolve_method(name, args)
    assert type(m.server.weighting) is expected


def test_fedavg_records_no_personal_views():
    rec = _sim("fedavg", rounds=1).round(1).record
    assert "personal_acc" not in rec and "trained_acc" not in rec
