"""FedGen's feature generator and its draws: a model both sides of FedGen use (the clients sample it for their
regularizer, the server trains it), so it lives beside the model zoo, in neither side's package."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Generator(nn.Module):
    """FedGen's feature generator (PFLlib's ``Generative``, after the official FedGen code): ``[ε, onehot(y)]`` →
    Linear(noise_dim + C, hidden_dim) → BatchNorm1d → ReLU → Linear(hidden_dim, feature_dim). The noise is an input,
    so every draw comes from a seeded generator."""

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.fc1 = nn.Sequential(nn.Linear(noise_dim + num_classes, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU())
        self.fc = nn.Linear(hidden_dim, feature_dim)

    def forward(self, labels: Tensor, noise: Tensor) -> Tensor:
        onehot = F.one_hot(labels, self.num_classes).to(noise.dtype)
        return self.fc(self.fc1(torch.cat([noise, onehot], dim=1)))

    def forward_rows(self, labels: Tensor, noise: Tensor) -> Tensor:
        """R independent training-mode forwards at once: ``labels [R, G]``, ``noise [R, G, noise_dim]`` →
        ``[R, G, feature_dim]``, each row's BatchNorm statistics over its own ``G`` draws (as R calls of
        :meth:`forward` on a module in training mode; the running statistics, which training mode never reads, are
        left as they are)."""
        lin, bn, act = self.fc1
        r, g = labels.shape
        onehot = F.one_hot(labels, self.num_classes).to(noise.dtype)
        h = F.linear(torch.cat([noise, onehot], dim=2), lin.weight, lin.bias)  # [R, G, hidden]
        width = h.shape[2]
        rows = h.transpose(0, 1).reshape(g, r * width)  # each row's channels side by side: per-row statistics
        rows = F.batch_norm(rows, None, None, bn.weight.repeat(r), bn.bias.repeat(r), True, 0.0, bn.eps)
        return self.fc(act(rows.view(g, r, width).transpose(0, 1)))


def draw(shares: Tensor, batch: int, noise_dim: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``batch`` labels drawn with replacement from the class shares (PFLlib: uniformly from the pooled list of all
    clients' labels) and ``U[0, 1)`` noise (PFLlib's ``torch.rand``), on the CPU from ``generator``."""
    labels = torch.multinomial(shares.detach().cpu().double(), batch, replacement=True, generator=generator)
    return labels, torch.rand((batch, noise_dim), generator=generator)
