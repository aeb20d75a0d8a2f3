"""Model zoo: shapes, gradients, the body/head contract, normalization keys, parameter counts."""

import pytest
import torch

from fedskew.models import MODELS, body_keys, build_model, count_parameters, head_keys, norm_keys

SHAPES = {
    "mlp": [(1, 8), (1, 28), (3, 32)],
    "cnn": [(1, 8), (1, 28), (3, 32)],
    "lenet": [(1, 28), (3, 32)],
    "lenet_bn": [(1, 28), (3, 32)],
    "resnet8": [(3, 32)],
    "resnet10": [(3, 32)],
    "resnet18": [(3, 32)],
    "resnet34": [(3, 32)],
}


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_backward_and_split(name):
    for cin, size in SHAPES[name]:
        torch.manual_seed(0)
        m = build_model(name, in_channels=cin, image_size=size, num_classes=7)
        x = torch.randn(2, cin, size, size)
        out = m(x)
        assert out.shape == (2, 7)
        assert m.features(x).ndim == 2 and m.features(x).shape[0] == 2
        out.square().sum().backward()
        for pname, p in m.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        keys = set(m.state_dict())
        assert head_keys(m) | body_keys(m) == keys and not head_keys(m) & body_keys(m)
        assert head_keys(m) == {"head.weight", "head.bias"}


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
    ],
)
def test_bad_models(kwargs, msg):
    args = {"in_channels": 1, "image_size": 28, "num_classes": 10, **kwargs}
    with pytest.raises(ValueError, match=msg):
        build_model(args.pop("name"), **args)
