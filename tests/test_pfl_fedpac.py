"""FedPAC (issue 42): its feature statistics, the classifier-combination program against a direct solve, the
prototype pull, and the partial personalized models it sends (the head only; the body is the global one)."""

import numpy as np
import pytest
import torch
from torch import nn

from fedskew.catalog.fedpac import (
    PAC_H,
    PAC_PRESENT,
    PAC_PROTOS,
    PAC_V,
    FedPAC,
    PacHeads,
    PacRound,
    combination_weights,
    feature_statistics,
    global_prototypes,
    program_matrix,
    psd_or_repaired,
    simplex_qp,
    simplex_qp_exact,
)
from fedskew.client.local import LocalContext, TrainSettings, snapshot
from fedskew.client.prototypes import PROTO_COUNT, PROTO_MEAN
from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.engine.loop import Simulation
from fedskew.models import FedModel
from fedskew.protocol import RoundInput
from fedskew.server.uploads import check_model
from fedskew.server.weights import SampleWeights


def test_feature_statistics_follow_the_official_formulas():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(9, 4, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 0, 2, 2, 2, 0, 2, 0, 0])
    v, h = feature_statistics(z, y, 3)
    n, expected_v = 9, 0.0
    for k in (0, 2):
        zk = z[y == k]
        pk = zk.shape[0] / n
        mu = zk.mean(0)
        assert torch.allclose(h[k], pk * mu)
        expected_v += pk * torch.trace(zk.T @ zk / zk.shape[0]) - pk**2 * (mu * mu).sum()
    assert torch.equal(h[1], torch.zeros(4))  # a class the client lacks
    assert float(v) == pytest.approx(float(expected_v) / n, rel=1e-12)


def test_program_matrix_is_diag_v_plus_the_trace_distances():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 2, 4, generator=g, dtype=torch.float64)
    v = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    for i in range(3):
        p = program_matrix(v, h, i)
        for j in range(3):
            for m in range(3):
                trace = sum(torch.trace(torch.outer(h[i, k] - h[j, k], h[i, k] - h[m, k])) for k in range(2))
                assert p[j, m] == pytest.approx(float(trace) + (float(v[j]) if j == m else 0.0), abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_the_simplex_program_matches_an_exact_active_set_solve(seed):
    rng = np.random.default_rng(seed)
    k = 3 + seed % 3
    a = rng.normal(size=(k, k))
    p = a @ a.T + np.diag(rng.uniform(0, 0.5, size=k))
    p[0] += 3.0 * np.eye(k)[0]  # make some weights vanish at the optimum, on a face of the simplex
    exact = simplex_qp_exact(p)
    approx = simplex_qp(p)
    assert approx.sum() == pytest.approx(1.0, abs=1e-8) and np.all(approx >= 0)
    assert approx @ p @ approx == pytest.approx(exact @ p @ exact, abs=1e-9)
    assert np.allclose(approx, exact, atol=1e-4)


def test_a_worked_two_client_program():
    # diag(V) + D_0 for h_0 = (1, 0), h_1 = (0, 0), V = (1, 1): D_0 = [[0, 0], [0, 1]], so P = [[1, 0], [0, 2]];
    # min a² + 2b² on a + b = 1: a = 2/3, b = 1/3
    h = torch.tensor([[[1.0, 0.0]], [[0.0, 0.0]]], dtype=torch.float64)
    v = torch.ones(2, dtype=torch.float64)
    assert np.allclose(program_matrix(v, h, 0), [[1.0, 0.0], [0.0, 2.0]])
    (a0, a1) = combination_weights(v, h)
    assert np.allclose(a0, [2 / 3, 1 / 3], atol=1e-6)
    assert np.allclose(a1, [1 / 3, 2 / 3], atol=1e-6)  # P_1 = [[2, 0], [0, 1]]


def test_a_matrix_that_is_not_psd_is_repaired_from_its_eigenpairs():
    p = np.array([[1.0, 2.0], [2.0, 1.0]])  # eigenvalues 3 and -1
    fixed = psd_or_repaired(p)
    assert fixed is not None and np.allclose(fixed, 1.5 * np.ones((2, 2)))  # 3 · vvᵀ, v = (1, 1)/√2
    assert psd_or_repaired(np.eye(2)) is not None


def test_global_prototypes_average_the_holders_of_each_class_unweighted():
    means = torch.tensor([[[1.0, 1.0], [0.0, 0.0]], [[3.0, 5.0], [2.0, 2.0]]])
    counts = torch.tensor([[4.0, 0.0], [1.0, 7.0]])
    protos, present = global_prototypes(means, counts)
    assert torch.allclose(protos, torch.tensor([[2.0, 3.0], [2.0, 2.0]]))
    assert torch.equal(present, torch.tensor([1.0, 1.0]))


def test_the_body_phase_pulls_features_to_the_global_prototypes_of_present_classes_only():
    torch.manual_seed(0)
    model = FedModel(nn.Linear(3, 2), nn.Linear(2, 2))
    ctx = LocalContext(0, 1, model, snapshot(model), {}, {}, TrainSettings(1, 4, 0.1))
    ctx.phase = "body"
    protos = torch.tensor([[1.0, -1.0], [0.0, 0.0]])
    ctx.prepared = PacRound(torch.zeros(1), torch.zeros(2, 2), protos, torch.tensor([1.0, 0.0]))
    feats = torch.tensor([[0.5, 0.5], [2.0, 2.0]], requires_grad=True)
    y = torch.tensor([0, 1])
    logits = torch.zeros(2, 2)
    loss = FedPAC(lam=2.0).loss(ctx, logits, feats, y, torch.zeros(2, 3))
    loss.backward()
    # MSE over all 4 entries; only sample 0 (class 0 has a prototype) is pulled: d/df = 2·lam·(f − c)/4
    assert torch.allclose(feats.grad[0], 2 * 2.0 * (feats[0].detach() - protos[0]) / 4)
    assert torch.equal(feats.grad[1], torch.zeros(2))
    ctx.phase = "head"
    assert float(FedPAC(lam=2.0).loss(ctx, logits, feats, y, torch.zeros(2, 3))) == pytest.approx(np.log(2))


def test_pac_heads_send_each_participant_its_combined_head_only():
    g = torch.Generator().manual_seed(3)
    params = {"body.w": torch.randn(3, 4, generator=g), "head.weight": torch.randn(3, 2, 4, generator=g)}
    h = torch.randn(3, 2, 4, generator=g)
    extras = {PAC_V: torch.rand(3, 1, generator=g), PAC_H: h}
    counts = torch.tensor([10.0, 20.0, 30.0], dtype=torch.float64)
    glob = {n: t[0].clone() for n, t in params.items()}
    rin = RoundInput(1, (4, 7, 9), params, counts, extras, glob, frozenset(params))
    step = PacHeads(SampleWeights())
    out, _ = step.aggregate(rin, step.init(_ctx_for(params)))
    assert set(out.personal) == {4, 7, 9}
    alphas = combination_weights(extras[PAC_V], h)
    for k, cid in enumerate(rin.cids):
        assert set(out.personal[cid]) == {"head.weight"}
        expected = sum(float(alphas[k][j]) * params["head.weight"][j].double() for j in range(3))
        assert torch.allclose(out.personal[cid]["head.weight"].double(), expected, atol=1e-6)
    w = counts / counts.sum()
    assert torch.allclose(out.global_params["body.w"].double(), (w[:, None] * params["body.w"].double()).sum(0))


def _ctx_for(params):
    from fedskew.protocol import ServerContext

    template = {n: t[0] for n, t in params.items()}
    return ServerContext(10, 2, template, frozenset(template), np.full(10, 5.0))


def test_a_partial_personalized_model_is_checked_and_completed_by_the_global_model():
    template = {"body.w": torch.zeros(2), "head.weight": torch.zeros(3)}
    assert check_model({"head.weight": torch.ones(3)}, template, "x", partial=True) == []
    with pytest.raises(TypeError, match="missing tensors"):
        check_model({"head.weight": torch.ones(3)}, template, "x")
    with pytest.raises(TypeError, match="unknown tensors"):
        check_model({"head.other": torch.ones(3)}, template, "x", partial=True)
    cfg = make_config(None, {"clients": 4, "rounds": 2, "method": "fedpac", "db": None, "skew_probes": 0, "seed": 2})
    sim = Simulation(cfg, build_federated(cfg))
    sim.round(1)
    for cid in range(4):
        sent = sim.server.received(cid)
        assert list(sent) == list(sim.global_params)  # every entry, in the model's order
        for n, t in sent.items():
            if n.startswith("head."):
                assert torch.equal(t, sim.personal[cid][n])
            else:
                assert torch.equal(t, sim.global_params[n])
    assert set(sim.personal[0]) == {n for n in sim.global_params if n.startswith("head.")}
    # the next round's prototypes are broadcast
    assert set(sim.server.broadcast()) == {PAC_PROTOS, PAC_PRESENT}
    sim.round(2)


def test_pac_refuses_a_client_part_that_does_not_upload_its_statistics():
    from fedskew.methods import resolve_method
    from fedskew.schema import ConfigError

    with pytest.raises(ConfigError, match="pac reads what the fedpac client part uploads"):
        resolve_method("fedprox+pac", {})
    assert resolve_method("fedpac", {}).name == "fedpac+pac"
    assert PROTO_MEAN and PROTO_COUNT  # the generic prototype upload names FedPAC reuses
