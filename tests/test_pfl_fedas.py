"""FedAS (issue 42): the Fisher trace and weights against closed forms, the prototype alignment's step, the start
of a round (the aligned global body with the client's own head)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedskew.catalog.fedas import FISHER_TRACE, AsRound, FedAS, FisherWeights, align_body, fisher_trace
from fedskew.client.kernels import PERSONAL
from fedskew.client.local import LocalContext, TrainSettings, snapshot
from fedskew.models import FedModel
from fedskew.protocol import RoundInput

D, C = 3, 2


def _data(n=6):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, D, generator=g), torch.tensor([0, 1, 1, 0, 1, 1][:n])


def test_the_fisher_trace_sums_the_squared_batch_gradients():
    x, y = _data()
    torch.manual_seed(1)
    model = FedModel(nn.Flatten(), nn.Linear(D, C))
    trace = fisher_trace(model, x, y, batch=4)
    w, b = model.head.weight.detach().double(), model.head.bias.detach().double()
    expected = 0.0
    for lo in (0, 4):
        xb, yb = x[lo : lo + 4].double(), y[lo : lo + 4]
        g = (torch.softmax(xb @ w.T + b, 1) - F.one_hot(yb, C).double()) / xb.shape[0]
        expected += float((g.T @ xb).pow(2).sum() + g.sum(0).pow(2).sum())
    assert trace == pytest.approx(expected, rel=1e-5)


def test_the_fisher_trace_drops_the_last_partial_batch_as_training_does():
    x, y = _data()
    torch.manual_seed(1)
    model = FedModel(nn.Flatten(), nn.Linear(D, C))
    first = fisher_trace(model, x[:4], y[:4], batch=4)
    assert fisher_trace(model, x, y, batch=4, drop_last=True) == first  # rows 4..5 (a partial batch) left out
    assert fisher_trace(model, x, y, batch=4) > first
    # a client smaller than one batch keeps its one batch (the loop trains on it too: bs = min(batch, n))
    assert fisher_trace(model, x[:3], y[:3], batch=4, drop_last=True) == fisher_trace(model, x[:3], y[:3], batch=4)


def test_fisher_weights_are_each_participants_share_of_the_traces():
    rin = RoundInput(
        1, (0, 1, 2), {}, torch.ones(3, dtype=torch.float64), {}, {}, frozenset(),
        metrics={FISHER_TRACE: torch.tensor([1.0, 3.0, 4.0], dtype=torch.float64)},
    )  # fmt: skip
    weights, _ = FisherWeights()(rin, None, None)
    assert torch.allclose(weights, torch.tensor([0.125, 0.375, 0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="Fisher trace"):
        FisherWeights()(RoundInput(1, (0,), {}, torch.ones(1), {}, {}, frozenset()), None, None)


def test_the_alignment_step_is_the_mse_gradient_to_the_own_prototypes():
    x, y = _data()
    torch.manual_seed(2)
    model = FedModel(nn.Linear(D, 2), nn.Linear(2, C))
    a0, c0 = model.body.weight.detach().clone().double(), model.body.bias.detach().clone().double()
    protos = torch.tensor([[1.0, -1.0], [0.5, 2.0]], dtype=torch.float64)
    counts = torch.tensor([2.0, 4.0], dtype=torch.float64)
    align_body(model, protos, counts, x, y, lr=0.1, epochs=1, batch=16, generator=torch.Generator().manual_seed(0))
    xd = x.double()
    ga, gc = torch.zeros_like(a0), torch.zeros_like(c0)
    for c in (0, 1):
        xc = xd[y == c]
        r = xc @ a0.T + c0 - protos[c]  # [n_c, 2]
        scale = 2.0 / r.numel()  # d/dz of the mean over the class's n_c·2 entries
        ga += scale * r.T @ xc
        gc += scale * r.sum(0)
    assert torch.allclose(model.body.weight.detach().double(), a0 - 0.1 * ga, atol=1e-6)
    assert torch.allclose(model.body.bias.detach().double(), c0 - 0.1 * gc, atol=1e-6)


def test_a_round_starts_from_the_aligned_global_body_and_the_clients_own_head():
    x, y = _data()
    torch.manual_seed(3)
    model = FedModel(nn.Linear(D, 2), nn.Linear(2, C))
    received = snapshot(model)
    own = {n: t + 1.0 for n, t in received.items()}
    settings = TrainSettings(epochs=1, batch_size=4, lr=0.1)
    ctx = LocalContext(0, 2, model, received, {PERSONAL.name: own}, {}, settings)
    ctx.x, ctx.y, ctx.generator = x, y, torch.Generator().manual_seed(0)
    FedAS().begin(ctx)
    start = ctx.prep(AsRound).start
    assert start is not None
    assert torch.equal(start["head.weight"], own["head.weight"]) and torch.equal(start["head.bias"], own["head.bias"])
    assert not torch.equal(start["body.weight"], received["body.weight"])  # aligned: moved from the global body
    assert not torch.equal(start["body.weight"], own["body.weight"])
    fresh = LocalContext(1, 2, model, received, {}, {}, settings)
    fresh.x, fresh.y, fresh.generator = x, y, torch.Generator()
    FedAS().begin(fresh)
    assert fresh.prep(AsRound).start is None  # never trained: the received model
    # first_align (PFLlib): a client that never trained aligns the received body to its own (received) model's
    # prototypes, which still moves it (a within-class contraction), and keeps the received head
    first = LocalContext(1, 1, model, received, {}, {}, settings)
    first.x, first.y, first.generator = x, y, torch.Generator().manual_seed(0)
    FedAS(first_align=True).begin(first)
    start = first.prep(AsRound).start
    assert start is not None and torch.equal(start["head.weight"], received["head.weight"])
    assert not torch.equal(start["body.weight"], received["body.weight"])


def test_fisher_weighting_is_refused_without_fedas():
    from fedskew.methods import resolve_method
    from fedskew.schema import ConfigError

    with pytest.raises(ConfigError, match="fisher reads what the fedas client part uploads"):
        resolve_method("fedprox+fisher", {})
    assert resolve_method("fedas", {}).name == "fedas+fisher"


def test_the_drop_last_flag_sets_the_runs_setting():
    from fedskew.cli import build_parser
    from fedskew.commands.flags import config_from_args

    def cfg(*extra):
        return config_from_args(build_parser().parse_args(["run", "--method", "fedas", "--no-db", *extra]))

    assert cfg("--drop-last").drop_last is True
    assert cfg().drop_last is False
