"""FedDecorr (catalog/feddecorr.py) as an added loss term on any client part (client/terms.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import digits_simulation
from test_batched_clients import _same_states, _same_updates, _side_by_side

from fedskew.catalog.feddecorr import Decorrelation, decorrelation
from fedskew.catalog.fedprox import FedProx
from fedskew.client.local import LocalContext, TrainSettings
from fedskew.client.terms import WithTerm
from fedskew.engine.batched import batchable
from fedskew.methods import resolve_method
from fedskew.models import build_model


def test_the_penalty_is_the_formula_written_out():
    """z standardized per dimension (unbiased variance, eps 1e-8), K = zᵀz, the mean of the off-diagonal K² over B."""
    g = torch.Generator().manual_seed(0)
    f = torch.randn(6, 4, generator=g, dtype=torch.float64)
    b, d = f.shape
    z = (f - f.mean(0)) / torch.sqrt(1e-8 + f.var(0, unbiased=True))
    k = z.T @ z
    off = sum(float(k[i, j]) ** 2 for i in range(d) for j in range(d) if i != j) / (d * (d - 1))
    assert float(decorrelation(f)) == pytest.approx(off / b, rel=1e-12)
    # perfectly correlated dimensions: every off-diagonal K_ij = B - 1, so the penalty is (B - 1)² / B, its maximum
    same = torch.stack([f[:, 0]] * 4, dim=1)
    assert float(decorrelation(same)) == pytest.approx((b - 1) ** 2 / b, rel=1e-6)  # up to the eps
    assert float(decorrelation(f)) < float(decorrelation(same))
    assert float(decorrelation(f[:1])) == 0.0  # one sample: 0, as the official loss


def test_it_adds_to_the_hosts_own_loss_and_is_the_host_at_beta_zero():
    torch.manual_seed(0)
    model = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    received = {k: v.clone() for k, v in model.state_dict().items()}
    ctx = LocalContext(0, 1, model, received, {}, {}, TrainSettings(epochs=1, batch_size=8, lr=0.1))
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    feats = model.body(x)
    logits = model.head(feats)
    host = FedProx(mu=0.1)
    wrapped = WithTerm(host, Decorrelation(beta=0.5))
    want = host.loss(ctx, logits, feats, y, x) + 0.5 * decorrelation(feats)
    assert torch.equal(wrapped.loss(ctx, logits, feats, y, x), want)
    assert not torch.equal(want, F.cross_entropy(logits, y))
    off = WithTerm(host, Decorrelation(beta=0.0))
    assert torch.equal(off.loss(ctx, logits, feats, y, x), host.loss(ctx, logits, feats, y, x))


def test_it_composes_with_any_host_and_says_where_it_cannot_be_batched():
    mlp = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    for name in ("feddecorr", "fedprox+feddecorr", "scaffold+feddecorr", "feddecorr+disco", "fedavg+feddecorr+heal"):
        method = resolve_method(name, {"feddecorr.beta" if "heal" in name else "beta": 0.2})
        assert isinstance(method.client, WithTerm) and method.client.term.beta == 0.2
        assert batchable(method, mlp) is None, name
    assert isinstance(resolve_method("fedprox+feddecorr", {}).client.inner, FedProx)
    assert "masked per client" in batchable(resolve_method("moon+feddecorr", {}), mlp)
    with pytest.raises(Exception, match="beta"):
        resolve_method("feddecorr", {"beta": -1.0})


def test_beta_zero_is_the_host_bit_for_bit():
    a, b = digits_simulation("fedprox+feddecorr", {"beta": 0.0}), digits_simulation("fedprox")
    ra, rb = a.run(), b.run()
    assert [r["global_acc"] for r in ra] == [r["global_acc"] for r in rb]
    assert all(torch.equal(a.global_params[k], b.global_params[k]) for k in a.global_params)


@pytest.mark.parametrize("host", ["fedprox", "scaffold"])
def test_the_batched_path_trains_the_composition_as_the_sequential_one(host):
    seq, bat, rounds = _side_by_side(f"{host}+feddecorr", {"beta": 1e-4}, rounds=2)
    for _, _, ups_seq, ups_bat in rounds:
        _same_updates(ups_seq, ups_bat)
    _same_states(seq.client_states, bat.client_states)
    _, _, without = _side_by_side(host, rounds=1)
    a, b = rounds[0][2][0].params, without[0][2][0].params
    assert max((a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point()) > 1e-5  # not vacuous
