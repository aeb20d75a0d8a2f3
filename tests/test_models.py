"""Model zoo: shapes, gradients, the body/head contract, normalization keys, parameter counts."""

import pytest
import torch

from fedskew.models import (
    MODELS,
    body_keys,
    build_model,
    count_parameters,
    head_keys,
    norm_keys,
    projection_width,
)

SHAPES = {
    "mlp": [(1, 8), (1, 28), (3, 32)],
    "cnn": [(1, 8), (1, 28), (3, 32)],
    "lenet": [(1, 28), (3, 32)],
    "lenet_bn": [(1, 28), (3, 32)],
    "resnet8": [(3, 32)],
    "resnet10": [(3, 32)],
    "resnet18": [(3, 32)],
    "resnet34": [(3, 32)],
    "textcnn": [(50, 12), (1000, 64)],  # (vocabulary size, tokens per sample)
    "charlstm": [(80, 10), (80, 80)],  # LEAF's Shakespeare: 80 letters, 80 characters per sample
}


def _input(name: str, cin: int, size: int) -> torch.Tensor:
    """A batch of two: token ids ``[2, size]`` below ``cin`` for textcnn, images ``[2, cin, size, size]`` otherwise."""
    if name in ("textcnn", "charlstm"):
        return torch.randint(0, cin, (2, size))
    return torch.randn(2, cin, size, size)


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_backward_and_split(name):
    for cin, size in SHAPES[name]:
        torch.manual_seed(0)
        m = build_model(name, in_channels=cin, image_size=size, num_classes=7)
        x = _input(name, cin, size)
        out = m(x)
        assert out.shape == (2, 7)
        assert m.features(x).ndim == 2 and m.features(x).shape[0] == 2
        out.square().sum().backward()
        for pname, p in m.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        keys = set(m.state_dict())
        assert head_keys(m) | body_keys(m) == keys and not head_keys(m) & body_keys(m)
        assert head_keys(m) == {"head.weight", "head.bias"}


@pytest.mark.parametrize("name", list(MODELS))
def test_moon_projection_head_sits_between_body_and_classifier(name):
    cin, size = SHAPES[name][-1]
    torch.manual_seed(0)
    plain = build_model(name, in_channels=cin, image_size=size, num_classes=7)
    torch.manual_seed(0)
    m = build_model(name, in_channels=cin, image_size=size, num_classes=7, projection=32)
    d = plain.head.in_features
    proj = {k for k in m.state_dict() if k.startswith("body.proj.")}
    assert proj == {f"body.proj.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")}
    assert m.body.proj[0].weight.shape == (d, d) and m.body.proj[2].weight.shape == (32, d)  # d -> d -> 32
    assert m.head.weight.shape == (7, 32)  # the classifier reads the projection (official ModelFedCon)
    assert head_keys(m) == {"head.weight", "head.bias"} and body_keys(m) | head_keys(m) == set(m.state_dict())
    assert norm_keys(m) == norm_keys(plain)
    assert projection_width(m.state_dict()) == 32 and projection_width(plain.state_dict()) == 0
    # the base body is unchanged (same names, same initial values)
    base = plain.state_dict()
    assert all(torch.equal(m.state_dict()[k], v) for k, v in base.items() if k.startswith("body."))
    x = _input(name, cin, size)
    assert m.features(x).shape == (2, 32) and m(x).shape == (2, 7)
    m(x).square().sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    expected = count_parameters(plain) - (d * 7 + 7) + (d * d + d) + (d * 32 + 32) + (32 * 7 + 7)
    assert count_parameters(m) == expected


def test_parameter_counts_match_docs():
    # PFLlib FedAvgCNN on MNIST: 832 + 51,264 + 524,800 + 5,130
    assert count_parameters(build_model("cnn", in_channels=1, image_size=28, num_classes=10)) == 582_026
    assert count_parameters(build_model("mlp", in_channels=1, image_size=28, num_classes=10)) == 199_210
    assert count_parameters(build_model("lenet", in_channels=3, image_size=32, num_classes=10)) == 62_006
    # lenet + two BatchNorm2d (6 and 16 channels: 2 * (6 + 16) affine parameters)
    assert count_parameters(build_model("lenet_bn", in_channels=1, image_size=28, num_classes=10)) == 44_470
    bn = build_model("lenet_bn", in_channels=1, image_size=28, num_classes=10)
    assert len(norm_keys(bn)) == 10 and all(k.startswith("body.") for k in norm_keys(bn))
    assert count_parameters(build_model("resnet18", in_channels=3, image_size=32, num_classes=10)) == 11_173_962


def test_norm_keys():
    assert norm_keys(build_model("cnn", in_channels=1, image_size=28, num_classes=10)) == set()
    bn = build_model("resnet8", in_channels=3, image_size=32, num_classes=10, norm="bn")
    gn = build_model("resnet8", in_channels=3, image_size=32, num_classes=10, norm="gn")
    assert any(k.endswith("running_mean") for k in norm_keys(bn))
    assert norm_keys(gn) and not any("running" in k for k in norm_keys(gn))


def test_initialization_is_seeded():
    torch.manual_seed(3)
    a = build_model("cnn", in_channels=1, image_size=28, num_classes=10).state_dict()
    torch.manual_seed(3)
    b = build_model("cnn", in_channels=1, image_size=28, num_classes=10).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        ({"name": "vgg"}, "unknown model"),
        ({"name": "cnn", "image_size": 2}, "too small"),
        ({"name": "resnet8", "norm": "ln"}, "norm"),
        ({"name": "mlp", "projection": -1}, "projection"),
    ],
)
def test_bad_models(kwargs, msg):
    args = {"in_channels": 1, "image_size": 28, "num_classes": 10, **kwargs}
    with pytest.raises(ValueError, match=msg):
        build_model(args.pop("name"), **args)
