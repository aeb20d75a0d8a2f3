"""The model zoo. Every model is ``body`` (features, flattened) + ``head`` (classifier).

State-dict names therefore start with ``body.`` or ``head.``, which is what personalized methods split on (FedPer,
FedRep: local head), and :func:`norm_keys` names the normalization layers' entries (FedBN). No model uses dropout,
so forward passes are deterministic given the weights (the engine relies on it for reproducibility).

Text: ``textcnn`` reads int64 token ids ``[B, L]``; ``build_model`` then takes the vocabulary size as
``in_channels`` and the sequence length as ``image_size`` (what :func:`fedskew.data.pools.input_shape` gives for
token ids).

``build_model(..., projection=D)`` appends MOON's projection head to the body (``body.proj``: Linear d→d, ReLU,
Linear d→D) and makes the classifier read its D-dimensional output, as the official MOON model (``ModelFedCon``:
base → projection MLP → classifier); the body's output is then the projected representation MOON contrasts.

``build_model(..., head_module=f)`` replaces the linear classifier with ``f(head)``, a method's composite head made
from it (FedCP's conditional policy and two heads, GPFL's conditional valve and class embeddings): the state-dict
names stay under ``head.``, and entries under ``head.personal.`` are the ones the ``personal`` client-local group
keeps on each client (:data:`fedskew.engine.model_init.LOCAL_GROUPS`). The factory is called under the run's init
stream, so its own random weights are seeded too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

MODELS: dict[str, str] = {
    "mlp": "2-hidden-layer MLP 200-200 (McMahan et al. 2017, '2NN')",
    "cnn": "PFLlib's FedAvgCNN: conv5x5 32, pool, conv5x5 64, pool, FC 512, FC classes (FedSA/FedPake experiments)",
    "lenet": "FedDisco's simple CNN: conv5x5 6, pool, conv5x5 16, pool, FC 120, FC 84, FC classes",
    "lenet_bn": "lenet with BatchNorm after each conv (a CPU-sized BN model for FedBN/FedCAC comparisons)",
    "resnet8": "CIFAR ResNet-8: 3x3 stem 16, three stages of one basic block (16/32/64), global pool",
    "resnet10": "CIFAR ResNet-10: 3x3 stem 64, four stages of one basic block (64/128/256/512)",
    "resnet18": "CIFAR ResNet-18: 3x3 stem 64, no max-pool, basic blocks [2,2,2,2]",
    "resnet34": "CIFAR ResNet-34: 3x3 stem 64, no max-pool, basic blocks [3,4,6,3]",
    "textcnn": "TextCNN on token ids (FedDisco's AG News model): embedding 128, convs 3/4/5 x 100, max over time",
    "charlstm": "LEAF's Shakespeare model on token ids: embedding 8, 2-layer LSTM 256, the last step's output",
}
TOKEN_MODELS = ("textcnn", "charlstm")  # the zoo's models of token ids (text)


class FedModel(nn.Module):
    """``forward(x) = head(body(x))``; ``features(x) = body(x)`` (flattened)."""

    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))

    def features(self, x: Tensor) -> Tensor:
        return self.body(x)


def _conv_out(size: int, kernel: int, padding: int) -> int:
    return size + 2 * padding - kernel + 1


def mlp(in_channels: int, image_size: int, num_classes: int) -> FedModel:
    d = in_channels * image_size * image_size
    body = nn.Sequential(nn.Flatten(), nn.Linear(d, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU())
    return FedModel(body, nn.Linear(200, num_classes))


def _two_conv(
    in_channels: int, image_size: int, widths: tuple[int, int], name: str, bn: bool = False
) -> tuple[nn.Sequential, int]:
    """conv5x5 -> [BatchNorm] -> ReLU -> pool2, twice. Images under 16 px get padding 2 so 8x8 digits still fit."""
    pad = 2 if image_size < 16 else 0
    s = _conv_out(image_size, 5, pad) // 2
    s = _conv_out(s, 5, pad) // 2
    if s < 1:
        raise ValueError(f"model {name!r}: images of {image_size} px are too small for two 5x5 conv + pool stages")
    layers: list[nn.Module] = []
    cin = in_channels
    for w in widths:
        layers.append(nn.Conv2d(cin, w, 5, padding=pad))
        if bn:
            layers.append(nn.BatchNorm2d(w))
        layers += [nn.ReLU(), nn.MaxPool2d(2)]
        cin = w
    return nn.Sequential(*layers, nn.Flatten()), widths[1] * s * s


def cnn(in_channels: int, image_size: int, num_classes: int) -> FedModel:
    convs, flat = _two_conv(in_channels, image_size, (32, 64), "cnn")
    body = nn.Sequential(*convs, nn.Linear(flat, 512), nn.ReLU())
    return FedModel(body, nn.Linear(512, num_classes))


def lenet(in_channels: int, image_size: int, num_classes: int, bn: bool = False) -> FedModel:
    convs, flat = _two_conv(in_channels, image_size, (6, 16), "lenet_bn" if bn else "lenet", bn=bn)
    body = nn.Sequential(*convs, nn.Linear(flat, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU())
    return FedModel(body, nn.Linear(84, num_classes))


def _norm(kind: str, channels: int) -> nn.Module:
    # GroupNorm with 2 groups, as FedDisco's ResNet-18 (spec 2.6)
    return nn.BatchNorm2d(channels) if kind == "bn" else nn.GroupNorm(2, channels)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = _norm(norm, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = _norm(norm, cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), _norm(norm, cout))

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn1(self.conv1(x)).relu()
        out = self.bn2(self.conv2(out))
        return (out + self.shortcut(x)).relu()


def resnet(blocks: list[int], widths: list[int], in_channels: int, num_classes: int, norm: str) -> FedModel:
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False),
        _norm(norm, widths[0]),
        nn.ReLU(),
    ]
    cin = widths[0]
    for i, (n, w) in enumerate(zip(blocks, widths, strict=True)):
        for j in range(n):
            layers.append(BasicBlock(cin, w, 2 if (i > 0 and j == 0) else 1, norm))
            cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return FedModel(nn.Sequential(*layers), nn.Linear(cin, num_classes))


RESNETS = {
    "resnet8": ([1, 1, 1], [16, 32, 64]),
    "resnet10": ([1, 1, 1, 1], [64, 128, 256, 512]),
    "resnet18": ([2, 2, 2, 2], [64, 128, 256, 512]),
    "resnet34": ([3, 4, 6, 3], [64, 128, 256, 512]),
}


#: TextCNN (Kim 2014; the baseline of Zhang & Wallace 2015): embedding width, convolution widths, filters per width
TEXTCNN_EMBED, TEXTCNN_WIDTHS, TEXTCNN_FILTERS = 128, (3, 4, 5), 100


class TokenConvs(nn.Module):
    """TextCNN's feature extractor: token ids ``[B, L]`` -> embedding ``[B, L, E]`` (id 0 pads: its vector stays 0)
    -> for each width w a ``Conv1d(E, filters, w)`` over the sequence, ReLU, max over time -> the widths' maxima
    concatenated, ``[B, filters * len(widths)]``."""

    def __init__(self, vocab_size: int, embed_dim: int, widths: tuple[int, ...], filters: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        self.convs = nn.ModuleList(nn.Conv1d(embed_dim, filters, w) for w in widths)

    def forward(self, x: Tensor) -> Tensor:
        e = self.embedding(x).transpose(1, 2)  # [B, E, L]
        return torch.cat([conv(e).relu().amax(dim=2) for conv in self.convs], dim=1)


def textcnn(vocab_size: int, seq_len: int, num_classes: int) -> FedModel:
    """TextCNN on token ids of a ``vocab_size`` vocabulary, ``seq_len`` per sample; the head reads the 300 maxima."""
    if seq_len < max(TEXTCNN_WIDTHS):
        raise ValueError(
            f"model 'textcnn': sequences of {seq_len} tokens are shorter than its widest convolution "
            f"({max(TEXTCNN_WIDTHS)})"
        )
    body = nn.Sequential(TokenConvs(vocab_size, TEXTCNN_EMBED, TEXTCNN_WIDTHS, TEXTCNN_FILTERS))
    return FedModel(body, nn.Linear(TEXTCNN_FILTERS * len(TEXTCNN_WIDTHS), num_classes))


class LastStepLSTM(nn.Module):
    """LEAF's character model body (its ``stacked_lstm``): token ids ``[B, L]`` -> embedding ``[B, L, E]`` -> a
    ``layers``-layer LSTM of ``hidden`` units -> the last time step's output ``[B, hidden]``."""

    def __init__(self, vocab_size: int, embed_dim: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=layers, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(self.embedding(x))
        return out[:, -1]


def charlstm(vocab_size: int, seq_len: int, num_classes: int) -> FedModel:
    """LEAF's Shakespeare next-character model (Caldas et al. 2018, ``models/shakespeare/stacked_lstm.py``):
    embedding 8, two LSTM layers of 256 units, a linear classifier over the last step's output."""
    return FedModel(nn.Sequential(LastStepLSTM(vocab_size, 8, 256, 2)), nn.Linear(256, num_classes))


PROJECTION = "body.proj."  # state-dict prefix of MOON's projection head


def add_projection(model: FedModel, dim: int) -> FedModel:
    """MOON's projection head (Li, He, Song, CVPR 2021; the official ``ModelFedCon``): a 2-layer MLP ``d → d → dim``
    (Linear, ReLU, Linear) appended to the body as ``body.proj``, and a fresh classifier ``dim → classes`` reading
    its output. ``d`` is the width the classifier read before. The head stays ``head.*`` (FedPer/FedRep keep only
    the classifier local); the projection is part of the body, so it is trained and aggregated with it."""
    if dim < 1:
        raise ValueError(f"projection width must be >= 1, got {dim}")
    body, head = model.body, model.head
    if not isinstance(body, nn.Sequential) or not isinstance(head, nn.Linear):
        raise ValueError("add_projection needs a Sequential body and a Linear head")
    if hasattr(body, "proj"):
        raise ValueError("the model already has a projection head")
    d = head.in_features
    body.add_module("proj", nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, dim)))
    model.head = nn.Linear(dim, head.out_features)
    return model


HeadModule = Callable[[nn.Linear], nn.Module]  # a method's composite head made from the zoo's linear classifier


class LinearFrom(nn.Linear):
    """A ``Linear`` layer starting from another's weights, on its device: the heads a composite head makes from the
    classifier (subclass it to add buffers, as FedCP's and GPFL's personal heads do)."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__(
            source.in_features, source.out_features, bias=source.bias is not None, device=source.weight.device
        )
        with torch.no_grad():
            self.weight.copy_(source.weight)
            if source.bias is not None:
                self.bias.copy_(source.bias)


def replace_head(model: FedModel, head_module: HeadModule) -> FedModel:
    """``model`` with its linear classifier replaced by ``head_module(classifier)`` (module docstring)."""
    if not isinstance(model.head, nn.Linear):
        raise ValueError(f"a composite head is made from a Linear classifier, got {type(model.head).__name__}")
    model.head = head_module(model.head)
    return model


def build_model(
    name: str,
    *,
    in_channels: int,
    image_size: int,
    num_classes: int,
    norm: str = "bn",
    projection: int = 0,
    head_module: HeadModule | None = None,
) -> FedModel:
    """Build a zoo model for ``in_channels x image_size x image_size`` inputs and ``num_classes`` outputs (``textcnn``:
    a vocabulary of ``in_channels`` ids, sequences of ``image_size`` tokens); ``projection > 0`` adds MOON's
    projection head of that width (:func:`add_projection`); ``head_module`` replaces the classifier with a method's
    composite head (:func:`replace_head`)."""
    if norm not in ("bn", "gn"):
        raise ValueError(f"norm must be 'bn' or 'gn', got {norm!r}")
    if in_channels < 1 or image_size < 1 or num_classes < 2:
        raise ValueError(f"bad model shape: in_channels={in_channels}, image_size={image_size}, classes={num_classes}")
    if projection < 0:
        raise ValueError(f"projection must be >= 0 (0: none), got {projection}")
    if name == "mlp":
        model = mlp(in_channels, image_size, num_classes)
    elif name == "cnn":
        model = cnn(in_channels, image_size, num_classes)
    elif name in ("lenet", "lenet_bn"):
        model = lenet(in_channels, image_size, num_classes, bn=name == "lenet_bn")
    elif name == "textcnn":
        model = textcnn(in_channels, image_size, num_classes)
    elif name == "charlstm":
        model = charlstm(in_channels, image_size, num_classes)
    elif name in RESNETS:
        blocks, widths = RESNETS[name]
        model = resnet(blocks, widths, in_channels, num_classes, norm)
    else:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(MODELS)}")
    if projection:
        model = add_projection(model, projection)
    return replace_head(model, head_module) if head_module is not None else model


def projection_width(params: Mapping[str, Tensor]) -> int:
    """The output width of the MOON projection head in a state dict (0: the model has none)."""
    last = params.get(f"{PROJECTION}2.weight")
    return int(last.shape[0]) if last is not None else 0


def head_keys(model: nn.Module) -> set[str]:
    return {k for k in model.state_dict() if k.startswith("head.")}


def body_keys(model: nn.Module) -> set[str]:
    return {k for k in model.state_dict() if k.startswith("body.")}


def buffer_keys(model: nn.Module) -> set[str]:
    return {k for k, _ in model.named_buffers()}


def norm_keys(model: nn.Module) -> set[str]:
    """State-dict entries of BatchNorm/GroupNorm layers (affine parameters and running statistics)."""
    out: set[str] = set()
    for mname, module in model.named_modules():
        if isinstance(module, nn.BatchNorm2d | nn.GroupNorm | nn.BatchNorm1d):
            out |= {f"{mname}.{k}" for k in module.state_dict()}
    return out


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
