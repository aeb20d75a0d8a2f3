"""FedPer, LG-FedAvg, FedBN and Separate ("local"): server plug-ins that keep state-dict groups on the clients.

Those entries never travel: every client trains and evaluates with its own, and the server averages the rest.
``fedper`` keeps the classifier head (``head``), ``lgfedavg`` everything but the head (``body``: LG-FedAvg's local
representations; as PFLlib's ``serverlg.py``, only the head travels and is averaged), ``fedbn`` the BatchNorm layers
(``norm``: affine and running statistics), ``local`` everything (``all``: no collaboration; the FedCAC paper's
"Separate"). The groups are the engine's (``fedskew.engine.model_init.LOCAL_GROUPS``); a plug-in returns them from
its build as ``local``.
"""

from __future__ import annotations

from fedskew.registry import ClientPart, NoParams, ServerPlugin, keep_local

CLIENTS: dict[str, ClientPart] = {}
SERVER_PLUGINS: dict[str, ServerPlugin] = {
    "local": ServerPlugin(
        "local",
        "no collaboration: every state-dict entry stays on its client (the FedCAC paper's 'Separate')",
        "local training only (baseline in FedCAC, Wu et al., NeurIPS 2023)",
        NoParams,
        (),
        keep_local("all"),
    ),
    "fedper": ServerPlugin(
        "fedper",
        "the classifier head stays on each client; the body is averaged",
        "Arivazhagan et al., Federated Learning with Personalization Layers, arXiv 1912.00818",
        NoParams,
        (),
        keep_local("head"),
    ),
    "lgfedavg": ServerPlugin(
        "lgfedavg",
        "local representations: every entry but the classifier head stays on each client; the head is averaged",
        "Liang et al., Think Locally, Act Globally: Federated Learning with Local and Global Representations, "
        "arXiv 2001.01523, 2020",
        NoParams,
        (),
        keep_local("body"),
    ),
    "fedbn": ServerPlugin(
        "fedbn",
        "BatchNorm layers (affine and running statistics) stay on each client; the rest is averaged",
        "Li et al., FedBN: Federated Learning on Non-IID Features via Local Batch Normalization, ICLR 2021",
        NoParams,
        (),
        keep_local("norm"),
    ),
}
ALIASES = {"separate": "local"}
