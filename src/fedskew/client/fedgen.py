"""FedGen as PFLlib implements it (the FedSA/FedPake paper's "FedGen"): a server-trained feature generator.

Zhu, Hong, Zhou, *Data-Free Knowledge Distillation for Heterogeneous Federated Learning*, ICML 2021; PFLlib's
``system/flcore/clients/clientgen.py`` and ``servers/servergen.py`` (their defaults are the paper's settings, spec
§1.1). One round::

    client k:  loss = CE(model(x), y) + gen_weight · CE(head(G(ŷ, ε)), ŷ)     ŷ ~ global label shares, ε ~ U[0, 1)
    server:    server_epochs Adam steps on G:  min CE(Σ_k p_k head_k(G(ŷ, ε)), ŷ)     p_k: participants' sample shares
               then G is broadcast with the next model (the model itself is aggregated by the server step as usual)

``G`` maps ``[ε, onehot(ŷ)]`` through Linear → BatchNorm1d → ReLU → Linear to the body's feature width; it is used in
training mode everywhere (batch statistics), as in PFLlib. The generator's weights, its Adam state and the label
shares are the server-side state of this local algorithm (``server_init`` / ``server_update``), so a checkpoint
holds them; its random draws come from :attr:`fedskew.seeding.Purpose.FEDGEN` streams keyed by the round, the
clients' from their own seeded generator.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.protocol import LABEL_HIST, ClientReport, Params, RoundInput, ServerContext, State
from fedskew.schema import ConfigError
from fedskew.seeding import Purpose, torch_generator, torch_seed

PREFIX = "fedgen/"  # broadcast: the generator's state-dict entries
LABELS = "fedgen_label_shares"  # broadcast: [C] share of each class among all clients' training labels


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


def draw(shares: Tensor, batch: int, noise_dim: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``batch`` labels drawn with replacement from the class shares (PFLlib: uniformly from the pooled list of all
    clients' labels) and ``U[0, 1)`` noise (PFLlib's ``torch.rand``), on the CPU from ``generator``."""
    labels = torch.multinomial(shares.detach().cpu().double(), batch, replacement=True, generator=generator)
    return labels, torch.rand((batch, noise_dim), generator=generator)


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


@dataclass
class FedGen(LocalAlgorithm):
    """FedGen's client regularizer and server-side generator training (see the module docstring).

    Defaults, PFLlib's ``main.py`` (= the FedSA/FedPake paper's settings): ``noise_dim = 512``, ``hidden_dim = 512``,
    ``generator_lr = 0.005`` (Adam, betas 0.9/0.999), ``server_epochs = 1000`` (generator steps per round),
    ``gen_batch_size = 10`` (PFLlib uses its local batch size, default 10, for both the clients' and the server's
    generated batches); ``gen_weight = 1`` (PFLlib adds the term unweighted; 0 turns it off)."""

    noise_dim: int = 512
    hidden_dim: int = 512
    generator_lr: float = 0.005
    server_epochs: int = 1000
    gen_batch_size: int = 10
    gen_weight: float = 1.0
    _cache: dict[tuple[int, int, str], Generator] = field(default_factory=dict, repr=False)
    # the server's generator samples labels by their share over all clients: each client's label histogram
    reports: ClassVar[tuple[ClientReport, ...]] = (LABEL_HIST,)

    def build_generator(self, num_classes: int, feature_dim: int, device: torch.device) -> Generator:
        """A generator of this configuration (weights drawn from the global RNG, which callers fork and seed)."""
        return Generator(self.noise_dim, num_classes, self.hidden_dim, feature_dim).to(device)

    # ---- client ----------------------------------------------------------------------------------------------
    def _client_generator(self, ctx: LocalContext) -> Generator:
        c, d = ctx.model.head.weight.shape  # type: ignore[union-attr]
        device = ctx.model.head.weight.device  # type: ignore[union-attr]
        key = (int(c), int(d), str(device))
        if key not in self._cache:
            with torch.random.fork_rng(devices=[]):  # its weights are overwritten: keep the global RNG untouched
                gen = self.build_generator(int(c), int(d), device)
            for q in gen.parameters():
                q.requires_grad_(False)
            self._cache[key] = gen
        gen = self._cache[key]
        gen.load_state_dict({k[len(PREFIX) :]: v for k, v in ctx.broadcast.items() if k.startswith(PREFIX)})
        gen.train()  # batch statistics, as PFLlib's generator, which never leaves training mode
        return gen

    def begin(self, ctx: LocalContext) -> None:
        if self.gen_weight != 0:
            ctx.scratch["fedgen"] = self._client_generator(ctx)

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        if self.gen_weight == 0:
            return ce
        assert ctx.generator is not None
        labels, noise = draw(ctx.broadcast[LABELS], self.gen_batch_size, self.noise_dim, ctx.generator)
        labels, noise = labels.to(logits.device), noise.to(logits.device)
        with torch.no_grad():
            z = ctx.scratch["fedgen"](labels, noise)
        return ce + self.gen_weight * F.cross_entropy(ctx.model.head(z), labels)

    # ---- server ----------------------------------------------------------------------------------------------
    def server_init(self, ctx: ServerContext) -> State:
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
        return {
            "generator": copy.deepcopy(gen.state_dict()),
            "optimizer": None,  # Adam's state after the latest training (None: fresh)
            "label_shares": (counts / counts.sum()).to(device),
            "seed": int(ctx.seed),
            "loss": float("nan"),
        }

    def broadcast(self, state: State) -> Params:
        return {**{PREFIX + k: v for k, v in state["generator"].items()}, LABELS: state["label_shares"]}

    def server_update(self, rin: RoundInput, state: State) -> State:
        weight, bias = rin.params["head.weight"], rin.params["head.bias"]
        c, d = int(weight.shape[1]), int(weight.shape[2])
        with torch.random.fork_rng(devices=[]):  # (the weights are loaded next)
            gen = self.build_generator(c, d, weight.device)
        gen.load_state_dict(state["generator"])
        opt = torch.optim.Adam(gen.parameters(), lr=self.generator_lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
        if state["optimizer"] is not None:
            opt.load_state_dict(state["optimizer"])
        shares = rin.num_samples / rin.num_samples.sum()
        loss = train_generator(
            gen,
            opt,
            weight.detach(),
            bias.detach(),
            shares.to(weight.device),
            state["label_shares"],
            steps=self.server_epochs,
            batch=self.gen_batch_size,
            noise_dim=self.noise_dim,
            generator=torch_generator(state["seed"], Purpose.FEDGEN, 1, rin.round),
        )
        return {
            **state,
            "generator": copy.deepcopy(gen.state_dict()),
            "optimizer": copy.deepcopy(opt.state_dict()),
            "loss": loss,
        }
