"""FedGen as PFLlib implements it (the FedSA/FedPake paper's "FedGen"): a server-trained feature generator.

Zhu, Hong, Zhou, *Data-Free Knowledge Distillation for Heterogeneous Federated Learning*, ICML 2021; PFLlib's
``system/flcore/clients/clientgen.py`` and ``servers/servergen.py`` (their defaults are the paper's settings, spec
§1.1). One round::

    client k:  loss = CE(model(x), y) + gen_weight · CE(head(G(ŷ, ε)), ŷ)     ŷ ~ global label shares, ε ~ U[0, 1)
    server:    server_epochs Adam steps on G:  min CE(Σ_k p_k head_k(G(ŷ, ε)), ŷ)     p_k: participants' sample shares
               then G is broadcast with the next model (the model itself is aggregated by the server step as usual)

``G`` (:class:`fedskew.models.generator.Generator`) maps ``[ε, onehot(ŷ)]`` through Linear → BatchNorm1d → ReLU →
Linear to the body's feature width; it is used in training mode everywhere (batch statistics), as in PFLlib. This
module holds the whole method: the exchanged tensors, the client part (:class:`FedGen`, with its batched form), the
server half that trains ``G`` (:class:`FedGenServer`: the generator's weights, its Adam state and the label shares are
its state, so a checkpoint holds them; its random draws come from :attr:`fedskew.seeding.Purpose.FEDGEN` streams
keyed by the round) and its registration. The clients draw from their own seeded generator.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import Tensor

from fedskew.client.batched_form import BatchedStep, GeneratedTerm, HeadTermFn
from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.models.generator import Generator, draw
from fedskew.protocol import LABEL_HIST, ClientReport, Params, RoundInput, ServerContext
from fedskew.registry import NO_GLOBAL_MODEL, ClientPart, ServerPlugin
from fedskew.schema import ConfigError, StrictSettings
from fedskew.seeding import Purpose, global_rng, torch_generator, torch_seed
from fedskew.server.api import ServerHalf

# the tensors the server half broadcasts
FEDGEN_GENERATOR = "fedgen/"  # the generator's state-dict entries, each named with this prefix
FEDGEN_LABELS = "fedgen_label_shares"  # [C] each class's share of all clients' training labels


# ---- client ----------------------------------------------------------------------------------------------------------
@dataclass
class FedGen(LocalAlgorithm):
    """FedGen's client regularizer (see the module docstring); the server half, which trains the generator, takes
    the same ``noise_dim``, ``hidden_dim`` and ``gen_batch_size`` (one schema: :class:`FedGenParams`).

    Defaults, PFLlib's ``main.py`` (= the FedSA/FedPake paper's settings): ``noise_dim = 512``, ``hidden_dim = 512``,
    ``gen_batch_size = 10`` (PFLlib uses its local batch size, default 10, for both the clients' and the server's
    generated batches); ``gen_weight = 1`` (PFLlib adds the term unweighted; 0 turns it off)."""

    noise_dim: int = 512
    hidden_dim: int = 512
    gen_batch_size: int = 10
    gen_weight: float = 1.0
    _cache: dict[tuple[int, int, str], Generator] = field(default_factory=dict, repr=False)

    def build_generator(self, num_classes: int, feature_dim: int, device: torch.device) -> Generator:
        """A generator of this configuration (weights drawn from the global RNG, which callers fork and seed)."""
        return Generator(self.noise_dim, num_classes, self.hidden_dim, feature_dim).to(device)

    def _client_generator(self, ctx: LocalContext) -> Generator:
        c, d = ctx.model.head.weight.shape  # type: ignore[union-attr]
        device = ctx.model.head.weight.device  # type: ignore[union-attr]
        key = (int(c), int(d), str(device))
        if key not in self._cache:
            with global_rng():  # its weights are overwritten: keep the global RNG untouched
                gen = self.build_generator(int(c), int(d), device)
            for q in gen.parameters():
                q.requires_grad_(False)
            self._cache[key] = gen
        gen = self._cache[key]
        prefix = FEDGEN_GENERATOR
        gen.load_state_dict({k[len(prefix) :]: v for k, v in ctx.broadcast.items() if k.startswith(prefix)})
        gen.train()  # batch statistics, as PFLlib's generator, which never leaves training mode
        return gen

    def begin(self, ctx: LocalContext) -> None:
        if self.gen_weight != 0:
            ctx.prepared = self._client_generator(ctx)

    def loss(self, ctx: LocalContext, logits: Tensor, features: Tensor, y: Tensor, x: Tensor) -> Tensor:
        ce = F.cross_entropy(logits, y)
        if self.gen_weight == 0:
            return ce
        assert ctx.generator is not None
        labels, noise = draw(ctx.broadcast[FEDGEN_LABELS], self.gen_batch_size, self.noise_dim, ctx.generator)
        labels, noise = labels.to(logits.device), noise.to(logits.device)
        with torch.no_grad():
            z = ctx.prep(Generator)(labels, noise)
        return ce + self.gen_weight * F.cross_entropy(ctx.model.head(z), labels)

    def batched_step(self) -> BatchedStep:
        weight, batch, noise_dim = float(self.gen_weight), int(self.gen_batch_size), int(self.noise_dim)

        def generated(ctx: LocalContext) -> GeneratedTerm | None:
            """``loss``'s regularizer per client: ``gen_weight · CE(head(z), ŷ)``, ``z`` the round's generator (the
            one ``begin`` loaded from the broadcast, in training mode) on the labels and noise the client drew."""
            if weight == 0:
                return None
            shares, gen = ctx.broadcast[FEDGEN_LABELS], ctx.prep(Generator)

            def inputs(labels: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
                return gen.forward_rows(labels, noise), labels

            return GeneratedTerm(lambda generator: draw(shares, batch, noise_dim, generator), inputs, head_term(weight))

        return BatchedStep(generated=generated)


@functools.cache
def head_term(weight: float) -> HeadTermFn:
    """``weight · CE(head(z), ŷ)`` per client on its drawn ``(z [R, G, d], ŷ [R, G])``, one function per weight (the
    captured steps replay the same graphs every round)."""

    def term(head: Callable[[Tensor], Tensor], drawn: tuple[Tensor, Tensor]) -> Tensor:
        z, labels = drawn
        logits = head(z)
        r, g = labels.shape
        ce = F.cross_entropy(logits.reshape(r * g, -1), labels.reshape(r * g), reduction="none")
        return weight * ce.view(r, g).mean(1)

    return term


# ---- server half -----------------------------------------------------------------------------------------------------
class GeneratorState(NamedTuple):
    """FedGen's server state."""

    generator: Params  # the generator's state dict
    optimizer: dict[str, Any] | None  # Adam's state after the latest training (None: fresh)
    label_shares: Tensor  # [C] each class's share of all clients' training labels
    seed: int  # the run seed, which keys the generator's draws
    loss: float  # the last generator step's loss (nan before any training)


@dataclass(frozen=True)
class FedGenServer(ServerHalf):
    """FedGen's server half: trains and broadcasts the generator. Defaults as :class:`FedGen`
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
        with global_rng(torch_seed(ctx.seed, Purpose.FEDGEN, 0)):
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
        with global_rng():  # (the weights are loaded next)
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


# ---- registration ----------------------------------------------------------------------------------------------------
class FedGenParams(StrictSettings):
    noise_dim: int = Field(512, ge=1)  # PFLlib -nd (FedSA/FedPake: "noise dim 512")
    hidden_dim: int = Field(512, ge=1)  # PFLlib -hd (FedSA/FedPake: "hidden dim 512")
    generator_lr: float = Field(0.005, gt=0)  # PFLlib -glr (FedSA/FedPake: "generator lr 0.005")
    server_epochs: int = Field(1000, ge=0)  # PFLlib -se: generator steps per round
    gen_batch_size: int = Field(10, ge=2)  # PFLlib uses -lbs (10); >= 2 for the generator's BatchNorm
    gen_weight: float = Field(1.0, ge=0)  # PFLlib adds the generated-feature loss with weight 1


CLIENTS: dict[str, ClientPart] = {
    "fedgen": ClientPart(
        "fedgen",
        "PFLlib's FedGen: server trains a feature generator on the clients' heads (1000 Adam steps/round, lr 0.005); "
        "clients add CE of their head on generated features",
        "Zhu, Hong, Zhou, Data-Free Knowledge Distillation for Heterogeneous Federated Learning, ICML 2021 "
        "(as implemented in PFLlib)",
        FedGenParams,
        lambda p: FedGen(
            noise_dim=p.noise_dim, hidden_dim=p.hidden_dim, gen_batch_size=p.gen_batch_size, gen_weight=p.gen_weight
        ),
        server_half=lambda p: FedGenServer(
            noise_dim=p.noise_dim,
            hidden_dim=p.hidden_dim,
            generator_lr=p.generator_lr,
            server_epochs=p.server_epochs,
            gen_batch_size=p.gen_batch_size,
        ),
        excludes=(NO_GLOBAL_MODEL,),
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
