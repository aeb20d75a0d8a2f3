"""LocalSGD (the local loop's optimizer) is torch.optim.SGD's step, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedskew.client.sgd import LocalSGD


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10), nn.Linear(10, 3))


@pytest.mark.parametrize(
    ("lr", "momentum", "weight_decay"),
    [(0.1, 0.0, 0.0), (0.05, 0.9, 0.0), (0.05, 0.9, 1e-3), (0.1, 0.0, 1e-2), (0.02, 0.5, 5e-4)],
)
def test_local_sgd_equals_torch_sgd(lr: float, momentum: float, weight_decay: float) -> None:
    ours, theirs = _model(0), _model(0)
    opt_ours = LocalSGD(list(ours.parameters()), lr=lr, momentum=momentum, weight_decay=weight_decay)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    g = torch.Generator().manual_seed(1)
    for step in range(12):
        x = torch.randn(5, 1, 8, 8, generator=g)
        y = torch.randint(0, 3, (5,), generator=g)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            if isinstance(opt, LocalSGD):
                opt.zero_grad()
            else:
                opt.zero_grad(set_to_none=True)
            # every third step the last layer is skipped: its parameters get no gradient and must not move
            # (and their momentum buffers must not advance), as torch.optim.SGD skips them
            h = model[:4](x)
            out = h[:, :3] if step % 3 == 2 else model[4](h)
            F.cross_entropy(out, y).backward()
            opt.step()
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a, b), f"step {step}: {name} differs"
    if momentum:
        for p_ours, p_theirs, buf in zip(ours.parameters(), theirs.parameters(), opt_ours.buffers, strict=True):
            assert torch.equal(buf, opt_theirs.state[p_theirs]["momentum_buffer"])
            assert p_ours.shape == buf.shape


def test_local_sgd_without_any_gradient_is_a_no_op() -> None:
    model = _model(0)
    before = [p.detach().clone() for p in model.parameters()]
    opt = LocalSGD(list(model.parameters()), lr=0.1, momentum=0.9)
    opt.zero_grad()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert opt.buffers == [None] * len(before)


def test_local_sgd_chooses_the_path_torch_sgd_would() -> None:
    opt = LocalSGD(list(_model(0).parameters()), lr=0.1)
    assert opt.foreach is False  # CPU tensors: torch.optim.SGD takes the single-tensor path


def test_mean_step_loss_equals_a_running_float64_sum() -> None:
    from fedskew.client.sgd import mean_step_loss

    g = torch.Generator().manual_seed(3)
    losses = [torch.rand((), generator=g) * 3 for _ in range(257)]
    sizes = [10] * 256 + [7]
    running = torch.zeros((), dtype=torch.float64)
    for loss, n in zip(losses, sizes, strict=True):
        running += loss * n
    assert mean_step_loss(losses, sizes) == float(running) / sum(sizes)
    assert mean_step_loss([], []) == 0.0


@pytest.mark.parametrize("head_lr", [None, 0.0])
def test_a_phase_trains_at_its_own_lr(head_lr) -> None:
    """``Phase.lr`` replaces the run's learning rate for that phase only: a head phase at lr 0 leaves the head as it
    was received, the body phase after it still trains; without it the head moves."""
    from fedskew.client.kernels import is_head
    from fedskew.client.local import LocalAlgorithm, LocalContext, Phase, TrainSettings, local_train
    from fedskew.models import build_model

    class TwoPhases(LocalAlgorithm):
        def phases(self, ctx):
            body = Phase(1, name="body", trains=lambda n: not is_head(n))
            return [Phase(1, name="head", trains=is_head, lr=head_lr), body]

    torch.manual_seed(0)
    model = build_model("mlp", in_channels=1, image_size=8, num_classes=3)
    received = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 1, 8, 8, generator=g), torch.randint(0, 3, (40,), generator=g)
    ctx = LocalContext(0, 1, model, received, {}, {}, TrainSettings(epochs=1, batch_size=10, lr=0.1, momentum=0.9))
    up = local_train(TwoPhases(), ctx, x, y, torch.Generator().manual_seed(0))
    head = max((up.params[k] - received[k]).abs().max().item() for k in received if is_head(k))
    body = max((up.params[k] - received[k]).abs().max().item() for k in received if not is_head(k))
    assert body > 1e-3
    assert (head == 0.0) if head_lr == 0.0 else (head > 1e-3)


def test_fedpac_head_lr_is_its_head_phase_lr() -> None:
    from fedskew.methods import resolve_method

    client = resolve_method("fedpac", {"head_lr": 0.1}).client
    ctx = type("Ctx", (), {"settings": type("S", (), {"epochs": 3})()})()
    assert [(p.name, p.epochs, p.lr) for p in client.phases(ctx)] == [("head", 1, 0.1), ("body", 3, None)]
    assert [p.lr for p in resolve_method("fedpac", {}).client.phases(ctx)] == [None, None]
