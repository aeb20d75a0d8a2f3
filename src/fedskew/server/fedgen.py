"""FedGen's server side (see :mod:`fedskew.client.fedgen` for the method): each round, ``server_epochs`` Adam steps
train the generator ``G`` to make the participants' heads, weighted by their sample shares, predict the labels it was
asked for; ``G`` and the label shares are then broadcast with the next model. The generator's weights, its Adam
state and the label shares are this server half's state, so a checkpoint holds them; its random draws come from
:attr:`fedskew.seeding.Purpose.FEDGEN` streams keyed by the round."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fedskew.models.generator import Generator, draw
from fedskew.protocol import (
    FEDGEN_GENERATOR,
    FEDGEN_LABELS,
    LABEL_HIST,
    ClientReport,
    Params,
    RoundInput,
    ServerContext,
)
from fedskew.schema import ConfigError
from fedskew.seeding import Purpose, torch_generator, torch_seed
from fedskew.server.api import ServerHalf


class GeneratorState(NamedTuple):
    """FedGen's server state."""

    generator: Params  # the generator's state dict
    optimizer: dict[str, Any] | None  # Adam's state after the latest training (None: fresh)
    label_shares: Tensor  # [C] each class's share of all clients' training labels
    seed: int  # the run seed, which keys the generator's draws
    loss: float  # the last generator step's loss (nan before any training)


@dataclass(frozen=True)
class FedGenServer(ServerHalf):
    """FedGen's server half: trains and broadcasts the generator. Defaults as :class:`fedskew.client.fedgen.FedGen`
    (PFLlib's: ``generator_lr = 0.005`` Adam, ``server_epochs = 1000``, ``gen_batch_size = 10``)."""

    noise_dim: int = 512
    hidden_dim: int = 512
    generator_lr: float = 0.005
    server_epochs: int = 1000
    gen_batch_size: int = 10
    # the generator samples labels by their share over all clients: each client's label histogram
    reports: ClassVar[tuple[ClientReport, ...]] = (LABEL_HIST,)

    def build_generator(self, num_classes: int, feature_dim: int, device: torch.device) -> Generator:
        """A generator of this configuration (weights drawn from the global RNG, which callers fork and seed)."""
        return Generator(self.noise_dim, num_classes, self.hidden_dim, feature_dim).to(device)

    def init(self, ctx: ServerContext) -> GeneratorState:
        c, d = head_shapes(ctx.template)
        device = ctx.template["head.weight"].device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(torch_seed(ctx.seed, Purpose.FEDGEN, 0))
            gen = self.build_generator(c, d, device)
        if ctx.label_hists is None:
            raise ConfigError("FedGen needs the clients' label histograms (its declared LABEL_HIST report)")
        counts = torch.as_tensor(ctx.label_hists, dtype=torch.float64).sum(0)
        if counts.sum() <= 0:
            raise ConfigError("FedGen: the clients hold no training labels")
        return GeneratorState(
            generator=copy.deepcopy(gen.state_dict()),
            optimizer=None,
            label_shares=(counts / counts.sum()).to(device),
            seed=int(ctx.seed),
            loss=float("nan"),
        )

    def broadcast(self, state: GeneratorState) -> Params:
        return {**{FEDGEN_GENERATOR + k: v for k, v in state.generator.items()}, FEDGEN_LABELS: state.label_shares}

    def advance(self, rin: RoundInput, state: GeneratorState) -> GeneratorState:
        weight, bias = rin.params["head.weight"], rin.params["head.bias"]
        c, d = int(weight.shape[1]), int(weight.shape[2])
        with torch.random.fork_rng(devices=[]):  # (the weights are loaded next)
            gen = self.build_generator(c, d, weight.device)
        gen.load_state_dict(state.generator)
        opt = torch.optim.Adam(gen.parameters(), lr=self.generator_lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
        if state.optimizer is not None:
            opt.load_state_dict(state.optimizer)
        shares = rin.num_samples / rin.num_samples.sum()
        loss = train_generator(
            gen,
            opt,
            weight.detach(),
            bias.detach(),
            shares.to(weight.device),
            state.label_shares,
            steps=self.server_epochs,
            batch=self.gen_batch_size,
            noise_dim=self.noise_dim,
            generator=torch_generator(state.seed, Purpose.FEDGEN, 1, rin.round),
        )
        return state._replace(
            generator=copy.deepcopy(gen.state_dict()), optimizer=copy.deepcopy(opt.state_dict()), loss=loss
        )


def ensemble_logits(z: Tensor, head_weight: Tensor, head_bias: Tensor, shares: Tensor) -> Tensor:
    """``Σ_k p_k (z W_kᵀ + b_k)``: the participants' linear heads (``[K, C, D]``, ``[K, C]``) on features ``z``
    (``[B, D]``), weighted by ``p`` (``[K]``)."""
    p = shares.to(z.dtype)
    return torch.einsum("bd,kcd,k->bc", z, head_weight.to(z.dtype), p) + p @ head_bias.to(z.dtype)


def head_shapes(template: Params) -> tuple[int, int]:
    """``(classes, feature width)`` of a model whose head is one Linear layer (``head.weight``, ``head.bias``)."""
    heads = sorted(n for n in template if n.startswith("head."))
    if heads != ["head.bias", "head.weight"] or template["head.weight"].dim() != 2:
        raise ConfigError(f"FedGen needs a model whose head is one Linear layer (head.weight, head.bias); got {heads}")
    c, d = template["head.weight"].shape
    return int(c), int(d)


def train_generator(
    gen: Generator,
    opt: torch.optim.Optimizer,
    head_weight: Tensor,
    head_bias: Tensor,
    client_shares: Tensor,
    label_shares: Tensor,
    *,
    steps: int,
    batch: int,
    noise_dim: int,
    generator: torch.Generator,
) -> float:
    """PFLlib's ``train_generator``: ``steps`` optimizer steps on ``CE(ensemble(G(ŷ, ε)), ŷ)``; the heads are fixed.
    Returns the last step's loss (``nan`` for no step)."""
    gen.train()
    device = head_weight.device
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        labels, noise = draw(label_shares, batch, noise_dim, generator)
        labels, noise = labels.to(device), noise.to(device)
        loss = F.cross_entropy(ensemble_logits(gen(labels, noise), head_weight, head_bias, client_shares), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.detach())
