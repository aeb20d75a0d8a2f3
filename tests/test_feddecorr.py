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
    for host in ("perfedavg", "pfedme"):  # a direction through inner steps on the cross-entropy: sequential
        assert "direction through inner steps" in batchable(resolve_method(f"{host}+feddecorr", {}), mlp)
    with pytest.raises(Exception, match="beta"):
        resolve_method("feddecorr", {"beta": -1.0})


def test_beta_zero_is_the_host_bit_for_bit():
    a, b = digits_simulation("fedprox+feddecorr", {"beta": 0.0}), digits_simulation("fedprox")
    ra, rb = a.run(), b.run()
    assert [r["global_acc"] for r in ra] == [r["global_acc"] for r in rb]
    assert all(torch.equal(a.global_params[k], b.global_params[k]) for k in a.global_params)


def test_over_padded_batches_each_client_gets_its_penalty_of_its_real_samples():
    """The padded form (captured steps): each row's penalty over its first ``count`` samples, whatever the padding
    holds; 0 for one sample or none; its gradient on a padding slot exactly 0."""
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(5, 7, 4, generator=g, dtype=torch.float64)
    counts = torch.tensor([7, 4, 2, 1, 0])
    weights = (torch.arange(7) < counts.unsqueeze(1)).to(torch.float64)
    feats[weights == 0] = 1e6  # the padding: any sample of the round, here far off
    feats.requires_grad_()
    got = decorrelation(feats, (weights, counts))
    want = [float(decorrelation(feats[k, : int(n)])) if n > 1 else 0.0 for k, n in enumerate(counts)]
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=0.0)
    assert all(v > 0 for v in want[:3])
    got.sum().backward()
    assert torch.equal(feats.grad[weights == 0], torch.zeros_like(feats.grad[weights == 0]))
    assert feats.grad[weights > 0].abs().max() > 0


def test_a_sum_with_a_per_sample_host_term_is_one_value_per_client():
    """``fedntd+feddecorr`` and ``fedproto+feddecorr``: the host's per-sample term, averaged over the real samples,
    plus the penalty ([K, B] + [K] broadcast once added the penalty along the batch); the same parts, one function."""
    from fedskew.client.batched_form import padded_mean
    from fedskew.client.terms import summed_term

    added = Decorrelation(beta=0.5).batched()
    assert added is Decorrelation(beta=0.5).batched()  # one function per beta: the captured graphs replay

    def host(feats, logits, y, outs):
        return logits.logsumexp(-1)  # [K, B]

    feats, logits = torch.randn(3, 6, 5), torch.randn(3, 6, 10)
    y = torch.zeros(3, 6, dtype=torch.long)
    padding = ((torch.arange(6) < torch.tensor([[6], [3], [2]])).float(), torch.tensor([6, 3, 2]))
    summed = summed_term(host, "sample", added)
    assert summed is summed_term(host, "sample", added)
    for pad in (None, padding):
        want = padded_mean(host(feats, logits, y, {}), pad) + 0.5 * decorrelation(feats, pad)
        assert torch.allclose(summed(feats, logits, y, {}, pad), want, rtol=1e-6)


@pytest.mark.parametrize(
    ("host", "args"),
    [
        ("fedprox", {"beta": 1e-4}),
        ("scaffold", {"beta": 1e-4}),
        ("fedntd", {"feddecorr.beta": 1e-4}),  # a per-sample host term: [K, B] plus the penalty's [K]
        ("fedproto", {"beta": 1e-4}),
        ("fedsam", {"beta": 1e-4}),  # SAM's second pass on the whole objective, the penalty at w + ε included
    ],
)
def test_the_batched_path_trains_the_composition_as_the_sequential_one(host, args):
    seq, bat, rounds = _side_by_side(f"{host}+feddecorr", args, rounds=2)
    for _, _, ups_seq, ups_bat in rounds:
        _same_updates(ups_seq, ups_bat)
    _same_states(seq.client_states, bat.client_states)
    _, _, without = _side_by_side(host, rounds=1)
    a, b = rounds[0][2][0].params, without[0][2][0].params
    assert max((a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point()) > 1e-5  # not vacuous
