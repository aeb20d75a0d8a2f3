"""FedExP (Jhunjhunwala et al., ICLR 2023): the extrapolated server step size (catalog/fedexp.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import digits_simulation

from fedskew.catalog.fedexp import FedExPStep
from fedskew.methods import resolve_method
from fedskew.protocol import ServerContext, Upload
from fedskew.schema import ConfigError
from fedskew.server.api import Aggregation
from fedskew.server.combine import WeightedMean
from fedskew.server.uploads import stack_uploads
from fedskew.server.weights import UniformWeights

W0 = {"w": torch.tensor([0.0, 0.0], dtype=torch.float64), "bn.running_mean": torch.tensor([1.0], dtype=torch.float64)}


def _aggregate(step, uploads):
    ups = [Upload(i, p, 10) for i, p in enumerate(uploads)]
    rin = stack_uploads(ups, rnd=1, global_params=W0, trainable=frozenset({"w"}))
    agg = Aggregation(weighting=UniformWeights(), combine=WeightedMean(), step=step)
    ctx = ServerContext(len(ups), 2, W0, frozenset({"w"}), np.ones(len(ups)))
    return agg.aggregate(rin, agg.init(ctx))[0]


def test_the_extrapolated_step_by_hand():
    """Δ_1 = [2, 0], Δ_2 = [-2, 0.2], uniform: Δ̄ = [0, 0.1], ‖Δ̄‖² = 0.01, mean ‖Δ_i‖² = 4.02; with ε = 1e-3 and
    the code's M·ε: η_g = 0.5·4.02/(0.01 + 0.002) = 167.5, so w = [0, 16.75]; with the paper's ε: 2.01/0.011."""
    f64 = torch.float64
    ups = [
        {"w": torch.tensor([2.0, 0.0], dtype=f64), "bn.running_mean": torch.tensor([3.0], dtype=f64)},
        {"w": torch.tensor([-2.0, 0.2], dtype=f64), "bn.running_mean": torch.tensor([5.0], dtype=f64)},
    ]
    out = _aggregate(FedExPStep(epsilon=1e-3), ups)
    assert out.diagnostics["fedexp_eta_g"] == pytest.approx(167.5, rel=1e-12)
    assert torch.allclose(out.global_params["w"], torch.tensor([0.0, 16.75], dtype=torch.float64), atol=1e-12)
    assert float(out.global_params["bn.running_mean"]) == 4.0  # a buffer takes the combined value
    paper = _aggregate(FedExPStep(epsilon=1e-3, epsilon_scale="none"), ups)
    assert paper.diagnostics["fedexp_eta_g"] == pytest.approx(2.01 / 0.011, rel=1e-12)


def test_agreeing_clients_get_fedavgs_step_and_the_official_codes_rule_agrees():
    same = [{"w": torch.tensor([1.0, 1.0], dtype=torch.float64), "bn.running_mean": W0["bn.running_mean"]}] * 3
    out = _aggregate(FedExPStep(), same)
    assert out.diagnostics["fedexp_eta_g"] == 1.0  # 0.5·2/(2 + 3e-3) < 1: no extrapolation
    assert torch.equal(out.global_params["w"], torch.tensor([1.0, 1.0], dtype=torch.float64))
    # the official main.py's rule, ported: grad_norm_avg = Σ p‖g‖²/Σ p, eta_g = max(1, 0.5·gna/(‖ḡ‖² + S·ε))
    rng = np.random.default_rng(0)
    g = rng.normal(size=(4, 2))
    p = np.full(4, 0.25)
    gna = float((p * (g**2).sum(1)).sum() / p.sum())
    gbar = (p[:, None] * g).sum(0) / p.sum()
    want = max(1.0, 0.5 * gna / (float((gbar**2).sum()) + 4 * 1e-3))
    ups = [{"w": torch.tensor(r), "bn.running_mean": W0["bn.running_mean"]} for r in g]
    assert _aggregate(FedExPStep(), ups).diagnostics["fedexp_eta_g"] == pytest.approx(want, rel=1e-12)


def test_it_composes_and_refuses_a_second_step():
    for name in ("fedexp", "fedprox+fedexp", "scaffold+fedexp", "fedavg+disco+fedexp"):
        recs = digits_simulation(name).run()
        assert all(math.isfinite(r["train_loss"]) for r in recs), name
        assert recs[-1]["diagnostics"]["fedexp_eta_g"] >= 1.0
    with pytest.raises(ConfigError, match="two plug-ins both set the server's step"):
        resolve_method("fedexp+fedadam", {})
    with pytest.raises(ConfigError, match="epsilon"):
        resolve_method("fedexp", {"epsilon": 0.0})


def test_the_step_is_the_same_whatever_the_hash_seed():
    """The update norms were summed in a frozenset's order, which changes with the process's hash seed, so two runs
    of one configuration differed in the last bits; the model's order is the same in every process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parent)
    code = (
        f"import sys; sys.path.insert(0, {tests!r}); from conftest import digits_simulation; "
        "r = digits_simulation('fedprox+fedexp', rounds=2).run(); "
        "print(repr(r[-1]['global_acc']), repr(r[-1]['diagnostics']['fedexp_eta_g']))"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2", "3")
    ]
    assert outs[0] and outs[0] == outs[1] == outs[2]
