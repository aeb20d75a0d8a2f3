"""The exchange before round 1 (``query.hello``): what the server says to every node, and what a node tells it.

The server sends :class:`Hello` (its fedskew version, its configuration hash and the client reports its method
declared, :class:`~fedskew.protocol.ClientReport`); each node answers with :class:`NodeReport` (its client id, data
shape, training sample count and those reports, computed on the node), which is all the server learns of a client's
data. Both sides build and read the records here, so the message has one definition. No ``flwr`` server import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedskew.data.pools import FederatedData
from fedskew.protocol import ClientReport


class FederationError(RuntimeError):
    """The federation cannot run as configured (nodes missing, duplicate client ids, ...); the message says why."""


@dataclass(frozen=True)
class Hello:
    """What the server says to every node before round 1: the client reports it needs, its version and config hash."""

    reports: tuple[str, ...]
    version: str
    config_hash: str


@dataclass(frozen=True)
class NodeReport:
    """What a node tells the server before round 1, and all the server learns of its data: its training sample
    count, the reports the method declared (name -> values), and its data's classes and input shape."""

    cid: int
    num_train: int
    reports: dict[str, list[float]]
    num_classes: int
    in_channels: int
    image_size: int
    domain: str = ""  # the domain its data comes from (its node config `domain`), for per-domain evaluation
    tokens: bool = False  # its samples are token ids [N, L] (text; in_channels is then the vocabulary size)
    vocabulary: str = ""  # text: a hash of its vocabulary (the words of the ids), which every node must share

    def content(self, version: str, digest: str) -> RecordDict:
        """The node's reply (``hello``: the numbers; ``node``: who it is and what it runs)."""
        values: dict[str, Any] = {"num_train": self.num_train, **self.reports}
        node = ConfigRecord(
            {
                "cid": self.cid,
                "fedskew_version": version,
                "config_hash": digest,
                "num_classes": self.num_classes,
                "in_channels": self.in_channels,
                "image_size": self.image_size,
                "domain": self.domain,
                "tokens": self.tokens,
                "vocabulary": self.vocabulary,
            }
        )
        return RecordDict({"hello": MetricRecord(values), "node": node, "meta": ConfigRecord({"cid": self.cid})})

    @classmethod
    def measure(
        cls,
        cid: int,
        train_hist: np.ndarray,
        shape: tuple[int, int, int],
        declared: Mapping[str, ClientReport],
        wanted: list[str],
        domain: str = "",
        tokens: bool = False,
        vocabulary: str = "",
    ) -> NodeReport:
        """What a node reports: its sample count and the reports asked for, from its own training label histogram
        (``shape``: its classes, input channels and image size; ``domain``: its node config's, if any)."""
        return cls(
            cid=cid,
            num_train=int(train_hist.sum()),
            reports={n: [float(v) for v in np.asarray(declared[n].compute(train_hist)).reshape(-1)] for n in wanted},
            num_classes=shape[0],
            in_channels=shape[1],
            image_size=shape[2],
            domain=domain,
            tokens=tokens,
            vocabulary=vocabulary,
        )

    @classmethod
    def read(cls, nid: int, content: RecordDict, request: Hello) -> NodeReport:
        """A hello reply, checked: the same fedskew version and configuration as the server, every report asked for,
        nothing else (a node sending more is refused: no data leaves a client unasked)."""
        node, hello = content["node"], content["hello"]
        cid = int(node["cid"])  # type: ignore[arg-type]
        version, digest = str(node["fedskew_version"]), str(node["config_hash"])
        if version != request.version:
            raise FederationError(
                f"node {nid} (client {cid}) runs fedskew {version}, the server fedskew {request.version}: every node "
                "must run the server's version (identical numbers depend on it)"
            )
        if digest != request.config_hash:
            raise FederationError(
                f"node {nid} (client {cid}) runs configuration {digest}, the server {request.config_hash}: the "
                "nodes read the run config differently (another fedskew build?)"
            )
        sent = set(hello) - {"num_train"}  # type: ignore[arg-type]
        if sent != set(request.reports):
            raise FederationError(
                f"node {nid} (client {cid}) reported {sorted(sent)}, the server asked for {sorted(request.reports)}"
            )
        return cls(
            cid=cid,
            num_train=int(hello["num_train"]),  # type: ignore[arg-type]
            reports={n: [float(v) for v in hello[n]] for n in request.reports},  # type: ignore[union-attr]
            num_classes=int(node["num_classes"]),  # type: ignore[arg-type]
            in_channels=int(node["in_channels"]),  # type: ignore[arg-type]
            image_size=int(node["image_size"]),  # type: ignore[arg-type]
            domain=str(node.get("domain", "")),
            tokens=bool(node.get("tokens", False)),
            vocabulary=str(node.get("vocabulary", "")),
        )


def known_of(reports: dict[int, NodeReport], request: Hello) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """What the server knows of the clients, as the engine takes it: sample counts ``[N]`` and every declared
    report as ``[N, d]``."""
    n = len(reports)
    num_train = np.array([reports[c].num_train for c in range(n)], dtype=np.int64)
    rows = {name: np.array([reports[c].reports[name] for c in range(n)], dtype=np.float64) for name in request.reports}
    return num_train, rows


def server_knows(view: FederatedData, reports: dict[int, NodeReport], request: Hello) -> dict[str, Any]:
    """``clients.json`` of a Flower run: everything the server learned of the clients' data (their sample counts and
    the reports the method declared), and the label histogram of its own test set."""
    n = len(reports)
    out: dict[str, Any] = {
        "num_classes": view.num_classes,
        "num_train": [reports[c].num_train for c in range(n)],
        "reports": {name: [reports[c].reports[name] for c in range(n)] for name in request.reports},
    }
    if len(view.y_test):
        out["global_test"] = np.bincount(view.y_test.cpu().numpy(), minlength=view.num_classes).tolist()
    return out
