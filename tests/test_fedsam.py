"""FedSAM and MoFedSAM (catalog/fedsam.py): sharpness-aware local steps, and FedCM's client momentum on them."""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torch.nn.functional as F
from conftest import Tiny, digits_simulation

from fedskew.catalog.fedsam import MOFEDSAM_DELTA, MOFEDSAM_STEPS, FedSAM, MoFedSAM, MoFedSAMServer
from fedskew.client.local import LocalAlgorithm, LocalContext, TrainSettings, local_train, snapshot
from fedskew.engine.batched import batchable
from fedskew.methods import resolve_method
from fedskew.models import build_model
from fedskew.protocol import ServerContext, Upload
from fedskew.server.uploads import stack_uploads


def _one_step(algo, model, x, y, lr=0.1, broadcast=None):
    settings = TrainSettings(epochs=1, batch_size=len(y), lr=lr)
    ctx = LocalContext(0, 1, model, snapshot(model), {}, broadcast or {}, settings)
    return local_train(algo, ctx, x, y, torch.Generator().manual_seed(0))


def test_one_sam_step_is_perturb_then_descend_written_out():
    """One batch, one step: g = ∇L(w), ε = ρ g/‖g‖ (one norm over all parameters), w' = w − lr·∇L(w + ε)."""
    torch.manual_seed(0)
    model, x, y = Tiny(), torch.randn(12, 4), torch.randint(0, 3, (12,))
    w = {n: p.detach().clone() for n, p in model.named_parameters()}
    rho, lr = 0.2, 0.1

    def loss_at(params):
        m = copy.deepcopy(model)
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(params[n])
        out = F.cross_entropy(m(x), y)
        return dict(zip(params, torch.autograd.grad(out, list(m.parameters())), strict=True))

    g = loss_at(w)
    norm = math.sqrt(sum(float((t**2).sum()) for t in g.values()))
    g2 = loss_at({n: w[n] + rho * g[n] / (norm + 1e-12) for n in w})
    want = {n: w[n] - lr * g2[n] for n in w}
    up = _one_step(FedSAM(rho=rho), model, x, y, lr)
    for n in want:
        assert torch.allclose(up.params[n], want[n], atol=1e-7), n
    # and it is not plain SGD's step
    assert not torch.allclose(up.params["head.weight"], w["head.weight"] - lr * g["head.weight"], atol=1e-5)


def test_rho_zero_is_fedavg_bit_for_bit_and_batchnorm_statistics_move_once_per_step():
    torch.manual_seed(0)
    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 10, (40,))
    base = build_model("lenet_bn", in_channels=1, image_size=8, num_classes=10)
    plain = _one_step(LocalAlgorithm(), copy.deepcopy(base), x, y)
    off = _one_step(FedSAM(rho=0.0), copy.deepcopy(base), x, y)
    assert all(torch.equal(plain.params[k], off.params[k]) for k in plain.params)
    sam = _one_step(FedSAM(rho=0.1), copy.deepcopy(base), x, y)
    stats = [k for k in plain.params if "running" in k or "num_batches" in k]
    assert stats
    for k in stats:  # the statistics are those of the one forward at w (the SAM pass leaves them)
        assert torch.equal(sam.params[k], plain.params[k]), k


def test_mofedsam_steps_with_alpha_g_sam_plus_the_servers_direction():
    torch.manual_seed(1)
    model, x, y = Tiny(), torch.randn(12, 4), torch.randint(0, 3, (12,))
    lr, alpha, rho = 0.1, 0.3, 0.05
    # no direction yet (round 1): the step is α·g_SAM
    first = _one_step(MoFedSAM(rho=rho, alpha=alpha), copy.deepcopy(model), x, y, lr)
    sam = _one_step(FedSAM(rho=rho), copy.deepcopy(model), x, y, lr * alpha)
    for n in sam.params:
        assert torch.allclose(first.params[n], sam.params[n], atol=1e-7), n
    # with a broadcast mean delta D over K steps: Δ = D/(K·lr), the step is α·g_SAM + (1 − α)·Δ
    d = {n: torch.full_like(p, 0.02) for n, p in model.named_parameters()}
    broadcast = {**{f"{MOFEDSAM_DELTA}{n}": t for n, t in d.items()}, MOFEDSAM_STEPS: torch.tensor(4.0)}
    moved = _one_step(MoFedSAM(rho=rho, alpha=alpha), copy.deepcopy(model), x, y, lr, broadcast)
    w = snapshot(model)
    for n in d:
        g_sam_part = first.params[n] - w[n]  # −lr·α·g_SAM
        want = w[n] + g_sam_part - lr * (1 - alpha) * d[n] / (4.0 * lr)
        assert torch.allclose(moved.params[n], want, atol=1e-7), n


def test_mofedsams_server_half_broadcasts_the_mean_client_delta_and_steps():
    template = {"w": torch.tensor([1.0, 1.0])}
    half = MoFedSAMServer()
    ctx = ServerContext(2, 3, template, frozenset({"w"}), np.ones(2))
    state = half.init(ctx)
    start = half.broadcast(state)
    assert start[MOFEDSAM_STEPS] == 0.0 and torch.equal(start["mofedsam_delta/w"], torch.zeros(2))
    ups = [
        Upload(0, {"w": torch.tensor([0.8, 1.0])}, 10, metrics={"steps": 4.0}),
        Upload(1, {"w": torch.tensor([0.6, 1.2])}, 30, metrics={"steps": 6.0}),
    ]
    rin = stack_uploads(ups, rnd=1, global_params=template, trainable=frozenset({"w"}))
    out = half.broadcast(half.advance(rin, state))
    assert torch.allclose(out["mofedsam_delta/w"], torch.tensor([0.3, -0.1]))  # uniform mean of w_t − w_i
    assert float(out[MOFEDSAM_STEPS]) == 5.0


def test_they_run_compose_and_train_batched():
    mlp = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    for name in ("fedsam", "mofedsam", "fedsam+disco"):
        method = resolve_method(name, {"rho": 0.05})
        assert batchable(method, mlp) is None  # equivalence: tests/test_batched_clients.py, test_captured_steps.py
        recs = digits_simulation(name, {"rho": 0.05}).run()
        assert all(math.isfinite(r["train_loss"]) for r in recs) and recs[-1]["global_acc"] > 0.1
