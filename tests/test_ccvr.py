"""CCVR (Luo et al., NeurIPS 2021): the classifier calibrated post hoc on virtual features (catalog/ccvr.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import digits_simulation
from torch import nn

from fedskew.catalog.ccvr import CCVR, class_moments
from fedskew.methods import resolve_method
from fedskew.schema import ConfigError
from fedskew.server.api import CalibrationKey


def test_pooled_client_moments_are_the_moments_of_all_features_together():
    """The paper's pooling of (N_c^k, μ_c^k, Σ_c^k) is exact: summed statistics give the mean and unbiased covariance
    of every client's features of a class together."""
    g = torch.Generator().manual_seed(0)
    piece = CCVR()
    feats = [torch.randn(n, 3, generator=g, dtype=torch.float64) + i for i, n in enumerate((7, 12, 5))]
    labels = [torch.randint(0, 2, (f.shape[0],), generator=g) for f in feats]
    stats = [piece.statistics(f, y, 3) for f, y in zip(feats, labels, strict=True)]
    total = {k: sum(s[k] for s in stats) for k in stats[0]}
    n, mean, cov = class_moments(total)
    allf, ally = torch.cat(feats), torch.cat(labels)
    for c in (0, 1):
        fc = allf[ally == c]
        assert int(n[c]) == fc.shape[0]
        assert torch.allclose(mean[c], fc.mean(0), atol=1e-12)
        assert torch.allclose(cov[c], torch.cov(fc.T), atol=1e-12)  # unbiased
        # the paper's formula on the clients' own (N, μ, Σ) gives the same
        parts = [(f[y == c], (f[y == c]).shape[0]) for f, y in zip(feats, labels, strict=True)]
        nc = sum(k for _, k in parts)
        mu = sum(k * p.mean(0) for p, k in parts if k) / nc
        sigma = sum((k - 1) / (nc - 1) * torch.cov(p.T) for p, k in parts if k > 1)
        sigma = sigma + sum(k / (nc - 1) * torch.outer(p.mean(0), p.mean(0)) for p, k in parts if k)
        sigma = sigma - nc / (nc - 1) * torch.outer(mu, mu)
        assert torch.allclose(cov[c], sigma, atol=1e-10)
    assert int(n[2]) == 0 and torch.equal(cov[2], torch.zeros(3, 3, dtype=torch.float64))


def test_the_calibrated_head_is_trained_on_seeded_virtual_features_only():
    piece = CCVR(samples_per_class=50)
    g = torch.Generator().manual_seed(1)
    stats = piece.statistics(torch.randn(40, 4, generator=g, dtype=torch.float64), torch.arange(40) % 2, 3)
    key = CalibrationKey(seed=3, round=5, lr=0.1, batch_size=10)
    x, y = piece.virtual(stats, key)
    assert x.shape == (100, 4) and sorted(set(y.tolist())) == [0, 1]  # class 2: no client holds it, no features
    again, _ = piece.virtual(stats, key)
    assert torch.equal(x, again)
    assert not torch.equal(x, piece.virtual(stats, key._replace(round=6))[0])
    head = nn.Linear(4, 3)
    glob = {"body.w": torch.ones(2), **{f"head.{k}": v.clone() for k, v in head.state_dict().items()}}
    out = piece.calibrate(glob, head, stats, key)
    assert torch.equal(out["body.w"], glob["body.w"]) and not torch.equal(out["head.weight"], glob["head.weight"])
    assert torch.equal(out["head.weight"], piece.calibrate(glob, nn.Linear(4, 3), stats, key)["head.weight"])


def test_training_is_the_hosts_bit_for_bit_and_the_views_score_the_calibrated_model():
    a, b = digits_simulation("ccvr", rounds=3), digits_simulation("fedavg", rounds=3)
    ra, rb = a.run(), b.run()
    assert all(torch.equal(a.global_params[k], b.global_params[k]) for k in a.global_params)  # post hoc
    assert [r["train_loss"] for r in ra] == [r["train_loss"] for r in rb]
    assert [r["global_acc"] for r in ra] != [r["global_acc"] for r in rb]
    # under Dir(0.1) the global head is biased towards the clients' majority classes; a balanced head helps
    assert sum(r["global_acc"] for r in ra) > sum(r["global_acc"] for r in rb)
    again = digits_simulation("ccvr", rounds=3).run()
    assert [r["global_acc"] for r in again] == [r["global_acc"] for r in ra]  # seeded


def test_it_composes_with_global_model_methods_only():
    for name in ("fedprox+ccvr", "fedavg+disco+ccvr", "scaffold+ccvr"):
        assert resolve_method(name, {}).calibration is not None
    for bad in ("fedper+ccvr", "ditto+ccvr"):
        with pytest.raises(ConfigError, match="keeps models or layers on the clients"):
            resolve_method(bad, {})


def test_flower_refuses_it_with_the_reason(tmp_path):
    pytest.importorskip("flwr")
    from fedskew.config import make_config
    from fedskew.flower.inprocess import make_grid, run_in_process

    cfg = make_config(None, {"method": "ccvr", "clients": 3, "rounds": 1, "out": str(tmp_path / "r"), "db": None})
    with pytest.raises(ConfigError, match="do not exchange yet; run it in the simulator"):
        run_in_process(cfg, grid=make_grid(cfg))


def test_a_part_may_not_name_a_hyper_parameter_as_a_run_setting():
    """The tuner and sweeps read ``lr``, ``batch_size``, ... as the run's own settings: a part's ``lr`` would be
    tuned as the clients' learning rate (CCVR's calibration rate was, before it became ``head_lr``)."""
    from fedskew.registry import ServerPlugin, register
    from fedskew.schema import StrictSettings

    class Clashing(StrictSettings):
        lr: float = 0.1

    with pytest.raises(ConfigError, match=r"\['lr'\] are named as the run's own settings"):
        register(ServerPlugin("clash_probe", "probe", "none", Clashing, (), lambda p: {}))


def test_a_flower_native_strategy_refuses_it_rather_than_dropping_the_calibration():
    pytest.importorskip("flwr")
    from fedskew.flower.strategies import FedskewStrategy

    with pytest.raises(ValueError, match="calibrates the evaluated model"):
        FedskewStrategy("ccvr")
    FedskewStrategy("fedavg+fedexp")  # a server step runs
