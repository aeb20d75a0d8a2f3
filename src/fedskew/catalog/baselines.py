"""The FedSA/FedPake paper's baselines beyond the core set: FedNTD, FedGen, FedBABU, FedALA (issue 13).

The FedSA/FedPake experiments ran in PFLlib (spec §1.1), so every default is PFLlib's unless its comment names the
paper it comes from; docs/methods.md lists where each method differs from its paper and from PFLlib. All four are
client parts: they compose with the server plug-ins (``fedntd+disco``, ``fedgen+heal``, ``fedala+fedsa``), except
``local`` (no collaboration, which none of them is about) and ``fedbabu+fedper`` (see :data:`_NO_LOCAL`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedskew.client.baselines import FedALA, FedBABU, FedNTD
from fedskew.client.fedgen import FedGen
from fedskew.registry import ClientPart, ServerPlugin
from fedskew.schema import StrictSettings
from fedskew.server.fedgen import FedGenServer

_NO_LOCAL = (
    "local",
    "'local' keeps every entry on the clients (no collaboration), so there is no global model for this method to use",
)


class FedNTDParams(StrictSettings):
    beta: float = Field(1.0, ge=0)  # official FedNTD config (PFLlib's shared -bt default 0 disables the term)
    tau: float = Field(1.0, gt=0)  # official FedNTD config and PFLlib's -tau


class FedGenParams(StrictSettings):
    noise_dim: int = Field(512, ge=1)  # PFLlib -nd (FedSA/FedPake: "noise dim 512")
    hidden_dim: int = Field(512, ge=1)  # PFLlib -hd (FedSA/FedPake: "hidden dim 512")
    generator_lr: float = Field(0.005, gt=0)  # PFLlib -glr (FedSA/FedPake: "generator lr 0.005")
    server_epochs: int = Field(1000, ge=0)  # PFLlib -se: generator steps per round
    gen_batch_size: int = Field(10, ge=2)  # PFLlib uses -lbs (10); >= 2 for the generator's BatchNorm
    gen_weight: float = Field(1.0, ge=0)  # PFLlib adds the generated-feature loss with weight 1


class FedBABUParams(StrictSettings):
    fine_tuning_epochs: int = Field(10, ge=1)  # PFLlib -fte (FedSA/FedPake: "fine-tuning epochs 10")
    fine_tune: Literal["full", "head"] = "full"  # PFLlib's fine_tune(['base', 'head']); the paper fine-tunes all
    fine_tune_every: int = Field(1, ge=1)  # fedskew: fine-tune in every k-th round only (PFLlib: once, at the end)
    # where fine-tuning starts: the client's model right after its local training (PFLlib serverbabu.py), or the
    # received global model (fedskew's earlier form)
    fine_tune_from: Literal["local", "global"] = "local"


class FedALAParams(StrictSettings):
    eta: float = Field(1.0, gt=0)  # PFLlib -et, FedALA paper
    rand_percent: float = Field(0.8, ge=0, le=1)  # PFLlib -s 80 (percent), FedSA/FedPake "0.8"
    layer_idx: int = Field(1, ge=0)  # FedSA/FedPake "higher layers number 1"; PFLlib's default 2; 0: no ALA
    threshold: float = Field(0.1, gt=0)  # PFLlib ALA.py
    num_pre_loss: int = Field(10, ge=1)  # PFLlib ALA.py
    max_start_epochs: int = Field(100, ge=1)  # fedskew's cap on the first weight learning (PFLlib: none)


CLIENTS: dict[str, ClientPart] = {
    "fedntd": ClientPart(
        "fedntd",
        "CE + beta * not-true-class distillation from the received global model (beta=1, tau=1)",
        "Lee, Jeong, Shin, Bae, Yun, Preservation of the Global Knowledge by Not-True Distillation in Federated "
        "Learning, NeurIPS 2022",
        FedNTDParams,
        lambda p: FedNTD(beta=p.beta, tau=p.tau),
        excludes=(_NO_LOCAL,),
    ),
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
        excludes=(_NO_LOCAL,),
    ),
    "fedbabu": ClientPart(
        "fedbabu",
        "body trained federatedly with the random head frozen; the locally trained model fine-tuned "
        "(fine_tuning_epochs=10, fine_tune_from=local as PFLlib) is the personal model",
        "Oh, Kim, Yun, FedBABU: Toward Enhanced Representation for Federated Image Classification, ICLR 2022",
        FedBABUParams,
        lambda p: FedBABU(**p.model_dump()),
        excludes=(
            _NO_LOCAL,
            (
                "fedper",
                "FedBABU never trains the head in the federated rounds, so keeping it local changes nothing; its "
                "personalization is the fine-tuning",
            ),
        ),
        personalized=True,
    ),
    "fedala": ClientPart(
        "fedala",
        "adaptive local aggregation of the received model into the previous local one on the top layer_idx=1 "
        "tensors (rand_percent=0.8, eta=1)",
        "Zhang, Hua, Wang, Song, Xue, Ma, Guan, FedALA: Adaptive Local Aggregation for Personalized Federated "
        "Learning, AAAI 2023",
        FedALAParams,
        lambda p: FedALA(**p.model_dump()),
        excludes=(_NO_LOCAL,),
        personalized=True,
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
