"""Your own data and model on fedskew: sensor-like feature windows, a small 1-D CNN, FedAvg vs FedProx.

Run: python examples/custom_data_model.py [--rounds 20]
"""

import argparse

import numpy as np
import torch
from torch import nn

import fedskew


def sensor_windows(n: int = 1200, length: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic 3-axis sensor windows [n, 3, length]: class k is a sine of frequency k+1 plus noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    t = np.linspace(0, 2 * np.pi, length)
    x = np.sin((y[:, None, None] + 1) * t + rng.uniform(0, np.pi, (n, 3, 1))) + 0.3 * rng.normal(size=(n, 3, length))
    return x.astype(np.float32), y


class SensorNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(3, 16, 5, padding=2), nn.ReLU(), nn.AdaptiveAvgPool1d(4), nn.Flatten())
        self.classifier = nn.Linear(64, 4)  # the last Linear: fedskew uses it as the head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.conv(x))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    x, y = sensor_windows()
    data = fedskew.from_arrays(x, y, name="sensors")  # fedskew partitions it: Dir(0.3) over 8 clients
    for method in ("fedavg", "fedprox"):
        result = fedskew.run(method, data, model=SensorNet, rounds=args.rounds, clients=8, alpha=0.3, lr=0.05)
        print(f"{method}: final global accuracy {result.records[-1]['global_acc']:.4f}")
