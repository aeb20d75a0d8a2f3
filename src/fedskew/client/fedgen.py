"""FedGen as PFLlib implements it (the FedSA/FedPake paper's "FedGen"): a server-trained feature generator.

Zhu, Hong, Zhou, *Data-Free Knowledge Distillation for Heterogeneous Federated Learning*, ICML 2021; PFLlib's
``system/flcore/clients/clientgen.py`` and ``servers/servergen.py`` (their defaults are the paper's settings, spec
§1.1). One round::

    client k:  loss = CE(model(x), y) + gen_weight · CE(head(G(ŷ, ε)), ŷ)     ŷ ~ global label shares, ε ~ U[0, 1)
    server:    server_epochs Adam steps on G:  min CE(Σ_k p_k head_k(G(ŷ, ε)), ŷ)     p_k: participants' sample shares
               then G is broadcast with the next model (the model itself is aggregated by the server step as usual)

``G`` (:class:`fedskew.models.generator.Generator`) maps ``[ε, onehot(ŷ)]`` through Linear → BatchNorm1d → ReLU →
Linear to the body's feature width; it is used in training mode everywhere (batch statistics), as in PFLlib. This
module is the client's part; the server's, which trains ``G``, is :class:`fedskew.server.fedgen.FedGenServer`. The
clients draw from their own seeded generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from fedskew.client.batched_form import BatchedStep, GeneratedTerm
from fedskew.client.local import LocalAlgorithm, LocalContext
from fedskew.models.generator import Generator, draw
from fedskew.protocol import FEDGEN_GENERATOR, FEDGEN_LABELS


@dataclass
class FedGen(LocalAlgorithm):
    """FedGen's client regularizer (see the module docstring); the server half, which trains the generator, takes
    the same ``noise_dim``, ``hidden_dim`` and ``gen_batch_size`` (one schema: ``catalog.baselines.FedGenParams``).

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
            with torch.random.fork_rng(devices=[]):  # its weights are overwritten: keep the global RNG untouched
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

            def term(head: Callable[[Tensor], Tensor], drawn: tuple[Tensor, Tensor]) -> Tensor:
                z, labels = drawn
                logits = head(z)
                r, g = labels.shape
                ce = F.cross_entropy(logits.reshape(r * g, -1), labels.reshape(r * g), reduction="none")
                return weight * ce.view(r, g).mean(1)

            return GeneratedTerm(lambda generator: draw(shares, batch, noise_dim, generator), inputs, term)

        return BatchedStep(generated=generated)
