"""Temporary minimal model zoo (mlp, cnn) so the engine can run; the full zoo replaces this file."""

from __future__ import annotations

from torch import nn


class _Net(nn.Module):
    def __init__(self, body: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x):
        return self.head(self.body(x))

    def features(self, x):
        return self.body(x)


def build_model(name: str, *, in_channels: int, image_size: int, num_classes: int, norm: str = "bn") -> nn.Module:
    if name == "mlp":
        d = in_channels * image_size * image_size
        return _Net(nn.Sequential(nn.Flatten(), nn.Linear(d, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU()),
                    nn.Linear(200, num_classes))
    if name == "cnn":
        pad = 2 if image_size < 16 else 0
        s = image_size
        s = (s + 2 * pad - 4) // 2
        s = (s + 2 * pad - 4) // 2
        body = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=pad), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * s * s, 512), nn.ReLU(),
        )
        return _Net(body, nn.Linear(512, num_classes))
    raise ValueError(f"unknown model {name!r}")
