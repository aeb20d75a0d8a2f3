"""engine/stacked.py: K clients' forward and backward as one autograd graph equals vmap(grad(...)) per client."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedskew.engine.stacked import stackable, stacked_forward
from fedskew.engine.stacked_step import stacked_step_function
from fedskew.engine.step_functions import step_function, vmap_step_function
from fedskew.models import build_model


def stacked_state(model: nn.Module, k: int, seed: int) -> dict[str, torch.Tensor]:
    """K different clients: the model's state dict perturbed per client (integer buffers repeated)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, v in model.state_dict().items():
        rows = v.unsqueeze(0).repeat(k, *[1] * v.dim()).clone()
        if rows.is_floating_point():
            rows += 0.05 * torch.randn(rows.shape, generator=g)
            if "running_var" in n:
                rows = rows.abs() + 0.5
        out[n] = rows
    return out


@pytest.mark.parametrize(
    ("name", "side", "mu"),
    [("mlp", 8, 0.0), ("cnn", 28, 0.0), ("lenet", 16, 0.3), ("lenet_bn", 16, 0.0), ("lenet_bn", 8, 0.1)],
)
def test_stacked_step_equals_vmap(name: str, side: int, mu: float) -> None:
    torch.manual_seed(0)
    model = build_model(name, in_channels=1, image_size=side, num_classes=10)
    model.train()
    k, b = 3, 5
    state = stacked_state(model, k, seed=1)
    names = [n for n, _ in model.named_parameters()]
    params = {n: state[n] for n in names}
    buffers = {n: v for n, v in state.items() if n not in params}
    anchor = {n: v + 0.01 for n, v in params.items()} if mu else {}
    x = torch.randn(k, b, 1, side, side, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 10, (k, b), generator=torch.Generator().manual_seed(3))
    g1, (l1, b1) = vmap_step_function(model, names, mu)(params, buffers, anchor, x, y)
    g2, (l2, b2, feats) = stacked_step_function(model, names, mu)(params, buffers, anchor, x, y)
    for n in names:
        assert torch.allclose(g1[n], g2[n], atol=1e-6, rtol=1e-5), n
    assert torch.allclose(l1, l2, atol=1e-6)
    body = {n[5:]: v for n, v in {**params, **buffers}.items() if n.startswith("body.")}
    assert torch.allclose(feats, stacked_forward(model.body, {k: v.clone() for k, v in body.items()}, x), atol=1e-6)
    assert set(b1) == set(b2) == set(buffers)
    for n in buffers:
        assert torch.allclose(b1[n].double(), b2[n].double(), atol=1e-6), n
    if name == "lenet_bn":  # the forward updated copies, never the inputs, and counted one batch per client
        assert not torch.equal(b2["body.1.running_mean"], buffers["body.1.running_mean"])
        assert b2["body.1.num_batches_tracked"].tolist() == (buffers["body.1.num_batches_tracked"] + 1).tolist()


@pytest.mark.parametrize("parts", [("scale",), ("shift",), ("scale", "shift")])
def test_each_clients_logit_map_is_the_same_on_both_paths(parts: tuple[str, ...]) -> None:
    """FedLC's and FedRS's per-client map of the logits before the loss, ``logits·scale + shift`` ([K, C] rows):
    the stacked graph and vmap agree, and the map changes the gradients."""
    torch.manual_seed(0)
    model = build_model("lenet", in_channels=1, image_size=16, num_classes=10)
    k, b = 3, 5
    state = stacked_state(model, k, seed=1)
    names = [n for n, _ in model.named_parameters()]
    params, anchor = {n: state[n] for n in names}, {}
    x = torch.randn(k, b, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 10, (k, b), generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(4)
    scale = torch.rand(k, 10, generator=g) + 0.2 if "scale" in parts else None
    shift = torch.randn(k, 10, generator=g) if "shift" in parts else None
    g1, (l1, _) = vmap_step_function(model, names, 0.0)(params, {}, anchor, x, y, logit_map=(scale, shift))
    g2, (l2, _, _) = stacked_step_function(model, names, 0.0)(params, {}, anchor, x, y, logit_map=(scale, shift))
    plain, (l0, _, _) = stacked_step_function(model, names, 0.0)(params, {}, anchor, x, y)
    assert torch.allclose(l1, l2, atol=1e-6) and not torch.allclose(l0, l2, atol=1e-3)
    for n in names:
        assert torch.allclose(g1[n], g2[n], atol=1e-6, rtol=1e-5), n
    # client 1's loss is its own batch's cross-entropy of its mapped logits
    model.load_state_dict({n: v[1] for n, v in state.items()})
    with torch.no_grad():
        logits = model(x[1])
        logits = logits * scale[1] if scale is not None else logits
        logits = logits + shift[1] if shift is not None else logits
        assert float(l2[1]) == pytest.approx(float(torch.nn.functional.cross_entropy(logits, y[1])), abs=1e-5)


def test_stacked_forward_is_each_clients_own_forward() -> None:
    """Client k's rows of the stacked forward are the module's forward with client k's tensors."""
    torch.manual_seed(0)
    model = build_model("lenet", in_channels=3, image_size=16, num_classes=4)
    k = 4
    state = stacked_state(model, k, seed=5)
    x = torch.randn(k, 6, 3, 16, 16)
    body = {n[5:]: v for n, v in state.items() if n.startswith("body.")}
    out = stacked_forward(model.body, body, x, training=False)
    for c in range(k):
        model.load_state_dict({n: v[c] for n, v in state.items()})
        model.eval()
        with torch.no_grad():
            assert torch.allclose(out[c], model.body(x[c]), atol=1e-5)


@pytest.mark.parametrize("name", ["mlp", "cnn", "lenet", "lenet_bn"])
def test_zoo_sequential_models_are_stackable(name: str) -> None:
    model = build_model(name, in_channels=1, image_size=16, num_classes=10)
    assert stackable(model.body) is None and stackable(model.head) is None
    names = [n for n, _ in model.named_parameters()]
    assert step_function(model, names, 0.0).__qualname__.startswith("stacked_step_function")


def test_unstackable_models_say_why_and_use_vmap() -> None:
    resnet = build_model("resnet8", in_channels=3, image_size=16, num_classes=10)
    why = stackable(resnet.body)
    assert why is not None and "has no stacked form" in why
    names = [n for n, _ in resnet.named_parameters()]
    assert not step_function(resnet, names, 0.0).__qualname__.startswith("stacked_step_function")
    assert "Flatten other than" in stackable(nn.Sequential(nn.Flatten(0)))
    assert "cumulative average" in stackable(nn.Sequential(nn.BatchNorm1d(3, momentum=None)))
    assert "padding" in stackable(nn.Conv2d(1, 2, 3, padding="same"))


class _Gated(nn.Module):
    """A module with its own forward and its own stacked form, reading a buffer and an extra input."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(5, 5), nn.LayerNorm([5]), nn.ReLU())
        self.table = nn.Embedding(3, 5)
        self.register_buffer("scale", torch.rand(5))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.inner(x * self.scale) + self.table(c)

    def stacked_forward(self, s, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return s("inner", x * s["scale"].unsqueeze(1)) + s("table", c)


def test_layernorms_embeddings_and_a_modules_own_stacked_form_are_each_clients_own_forward() -> None:
    """``LayerNorm`` (each client's affine map), ``Embedding`` (each client's table), a ``Linear`` subclass that keeps
    its forward and a module's own ``stacked_forward`` (its children's stacked forms, its buffers and extra inputs):
    client k's rows are the module's forward with client k's tensors; GPFL's and FedCP's composite heads too (FedCP's
    with each client's Gumbel draws)."""
    from fedskew.catalog.fedcp import CPHead
    from fedskew.catalog.gpfl import GPFLHead, PersonalHead

    torch.manual_seed(0)
    k = 3
    gated = _Gated()
    assert stackable(gated) is None
    state = stacked_state(gated, k, seed=1)
    x, c = torch.randn(k, 4, 5), torch.randint(0, 3, (k, 4))
    out = stacked_forward(gated, state, x, inputs=(c,))
    for i in range(k):
        gated.load_state_dict({n: v[i] for n, v in state.items()})
        assert torch.allclose(out[i], gated(x[i], c[i]), atol=1e-5)
    personal = PersonalHead(nn.Linear(5, 3))
    assert stackable(personal) is None  # a Linear subclass with buffers of its own, Linear's forward
    for make in (GPFLHead, CPHead):
        head = make(nn.Linear(5, 3))
        assert stackable(head) is None
        state = stacked_state(head, k, seed=2)
        drawn = torch.empty(k, 4, 2, 5).exponential_() if make is CPHead else None
        kwargs = {} if drawn is None else {"exponential": drawn}
        out = stacked_forward(head, state, x, kwargs=kwargs)
        for i in range(k):
            head.load_state_dict({n: v[i] for n, v in state.items()})
            one = {} if drawn is None else {"exponential": drawn[i]}
            assert torch.allclose(out[i], head(x[i], **one), atol=1e-5), make.__name__


def test_layers_without_a_stacked_form_say_why() -> None:
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).tanh()

    assert "Custom has no stacked form" in (stackable(Custom()) or "")
    assert "Embedding with a padding index" in (stackable(nn.Embedding(3, 2, padding_idx=0)) or "")

    class OwnForward(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    assert "OwnForward has no stacked form" in (stackable(OwnForward(2, 2)) or "")


def test_inputs_given_to_a_module_without_its_own_stacked_form_are_refused_not_dropped() -> None:
    head = nn.Linear(5, 3)
    state = stacked_state(head, 2, seed=0)
    with pytest.raises(ValueError, match=r"Linear \(Linear\) has no stacked form of its own.*given exponential"):
        stacked_forward(head, state, torch.randn(2, 4, 5), kwargs={"exponential": torch.ones(2, 4, 2, 5)})
    assert stacked_forward(head, state, torch.randn(2, 4, 5), kwargs={}).shape == (2, 4, 3)
