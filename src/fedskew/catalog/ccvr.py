"""CCVR (Luo, Chen, Hu, Zhang, Liang, Feng, "No Fear of Heterogeneity: Classifier Calibration for Federated Learning
with Non-IID Data", NeurIPS 2021): the classifier calibrated on virtual representations, post hoc.

At each evaluation, every client computes, for each class ``c`` it holds, the count ``N_c^k``, mean ``μ_c^k`` and
covariance ``Σ_c^k`` of its training features under the global model (its body, in eval mode); the server pools them
into the global ``μ_c`` and the unbiased ``Σ_c`` (the paper's formulas, which are exact: the pooled values equal the
mean and covariance of all clients' features together), draws ``samples_per_class`` virtual features per class from
``N(μ_c, Σ_c)`` and retrains the classifier head on them with SGD (cross-entropy, ``epochs`` passes, the clients'
batch size and learning rate by default). The global views score the calibrated model; the clients keep training
the global one (calibration is post hoc: tested bit for bit against the host's run). What a client sends is
equivalent to ``(N_c, Σ x, Σ x xᵀ)`` per class, which is what it computes (additive, so the server sums them).

Defaults: ``samples_per_class = 200``, one epoch (FL-bench's ``ccvr``, the public implementation, which calibrates a
copy at every evaluation, as here); the paper calibrates once, after training, which is the last round's evaluation.
A named difference from FL-bench: it pools population (``1/N``) client covariances with the unbiased formula's
``N − 1`` weights; fedskew pools the paper's unbiased covariances, exactly. A class no client holds gets no virtual
features; a class with one sample overall gets a zero covariance. Composes with any global-model method
(``fedprox+ccvr``, ``moon+ccvr``, ``fedavg+disco+ccvr``); refused with personalized ones. Flower: not yet (the
feature statistics would need an exchange of their own at evaluation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor, nn

from fedskew.protocol import Params
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.seeding import Purpose, numpy_rng, torch_generator
from fedskew.server.api import Calibration, CalibrationKey
from fedskew.space import Int, LogFloat


def class_moments(stats: Params) -> tuple[Tensor, Tensor, Tensor]:
    """From summed ``count [C]``, ``sum [C, d]`` and ``outer [C, d, d]`` (float64): the counts, the means ``[C, d]``
    and the unbiased covariances ``[C, d, d]`` (0 where a class has fewer than two samples)."""
    n, s, o = stats["count"], stats["sum"], stats["outer"]
    mean = s / n.clamp_min(1).unsqueeze(1)
    scatter = o - n.view(-1, 1, 1) * mean.unsqueeze(2) * mean.unsqueeze(1)
    cov = torch.where(n.view(-1, 1, 1) > 1, scatter / (n - 1).clamp_min(1).view(-1, 1, 1), torch.zeros_like(o))
    return n, mean, cov


@dataclass(frozen=True)
class CCVR(Calibration):
    """The classifier retrained on virtual features drawn from the pooled class Gaussians (module docstring)."""

    samples_per_class: int = 200
    epochs: int = 1
    head_lr: float | None = None  # None: the clients' learning rate
    head_batch_size: int | None = None  # None: the clients' batch size

    def statistics(self, features: Tensor, labels: Tensor, num_classes: int) -> Params:
        f = features.to(torch.float64)
        d = f.shape[1]
        count = torch.bincount(labels, minlength=num_classes).to(torch.float64)
        total = torch.zeros((num_classes, d), dtype=torch.float64, device=f.device).index_add_(0, labels, f)
        outer = torch.zeros((num_classes, d, d), dtype=torch.float64, device=f.device)
        for c in torch.unique(labels).tolist():  # one D x D product per class the client holds: n·D² in all
            fc = f[labels == c]
            outer[c] = fc.T @ fc
        return {"count": count, "sum": total, "outer": outer}

    def virtual(self, stats: Params, key: CalibrationKey) -> tuple[Tensor, Tensor]:
        """The virtual features ``[M, d]`` and their labels, ``samples_per_class`` per class some client holds."""
        n, mean, cov = class_moments({k: v.cpu() for k, v in stats.items()})  # drawn on the host (a GPU run's too)
        rng = numpy_rng(key.seed, Purpose.CALIBRATION, key.round, 0)
        xs, ys = [], []
        for c in range(n.shape[0]):
            if n[c] <= 0:
                continue
            draw = rng.multivariate_normal(mean[c].numpy(), cov[c].numpy(), self.samples_per_class, method="eigh")
            xs.append(torch.from_numpy(draw))
            ys.append(torch.full((self.samples_per_class,), c, dtype=torch.long))
        return torch.cat(xs), torch.cat(ys)

    def calibrate(self, global_params: Params, head: nn.Module, stats: Params, key: CalibrationKey) -> Params:
        x, y = self.virtual(stats, key)
        prefix = "head."
        head.load_state_dict({k[len(prefix) :]: v for k, v in global_params.items() if k.startswith(prefix)})
        head.train()
        dtype = next(head.parameters()).dtype
        device = next(head.parameters()).device
        x, y = x.to(dtype=dtype, device=device), y.to(device)
        opt = torch.optim.SGD(head.parameters(), lr=self.head_lr if self.head_lr is not None else key.lr)
        bs = self.head_batch_size or key.batch_size
        gen = torch_generator(key.seed, Purpose.CALIBRATION, key.round, 1)
        for _ in range(self.epochs):
            order = torch.randperm(x.shape[0], generator=gen).to(device)
            for i in range(0, x.shape[0], bs):
                idx = order[i : i + bs]
                opt.zero_grad()
                F.cross_entropy(head(x[idx]), y[idx]).backward()
                opt.step()
        tuned = {f"{prefix}{k}": v.detach().clone() for k, v in head.state_dict().items()}
        return {**global_params, **tuned}


# ---- registration ----------------------------------------------------------------------------------------------------
class CCVRParams(StrictSettings):
    samples_per_class: int = Field(200, ge=1)  # virtual features drawn per class (FL-bench's sample_per_class)
    epochs: int = Field(1, ge=1)  # passes of SGD over the virtual features
    head_lr: float | None = Field(None, gt=0)  # the calibration's learning rate (None: the clients')
    head_batch_size: int | None = Field(None, ge=1)  # its batch size (None: the clients')


CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "ccvr": ServerPlugin(
        "ccvr",
        "post-hoc: the classifier evaluated after retraining on virtual features from the pooled class Gaussians "
        "(200 per class, 1 epoch)",
        "Luo, Chen, Hu, Zhang, Liang, Feng, No Fear of Heterogeneity: Classifier Calibration for Federated Learning "
        "with Non-IID Data, NeurIPS 2021",
        CCVRParams,
        (),
        lambda p: {"calibrate": CCVR(**p.model_dump())},
        tunable={"samples_per_class": Int(50, 2000, log=True), "head_lr": LogFloat(1e-3, 1.0)},
    ),
}
