"""What a SuperNode knows of the data: only its own client's part, built once and cached on the node.

Two ways a node finds its data (``[tool.flwr.app.config.flower] data``):

* ``partition`` (the default, a *simulated deployment*): every node draws the simulator's partition of one dataset
  (``dataset``, ``data_dir``, partition and seed: what ``fedskew run`` draws, so results equal the simulator's) and
  keeps only its own part. The part is cached on the node (:func:`cached_part`), keyed by a hash of everything that
  decides it (the data settings, the client id and fedskew's version), written atomically; a later message, which
  Flower serves in a fresh ``flwr-clientapp`` process, loads the few megabytes of its part instead of the dataset.
* ``node`` (a *real federation*): the node's ``data-dir`` (its ``--node-config``) holds its own data in any format a
  fedskew reader takes (``--dataset npz``: ``x``, ``y`` and optionally ``x_test``, ``y_test``, ``num_classes``; an
  image ``folder``; ...). The files *are* its part: nothing is partitioned. Without a test split in the files the
  node splits its samples with ``train_ratio``, and it carves its ``validation`` share, with streams seeded by the run
  seed and its client id (the simulator's ``--partition given`` uses the same streams when every client has test
  files; docs/flower.md).

The cache lives in the node's ``cache-dir``, else fedskew's cache (``$FEDSKEW_CACHE``, default
``$XDG_CACHE_HOME/fedskew`` or ``~/.cache/fedskew``; ``off`` disables it); a file that cannot be read back is rebuilt,
never trusted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew import __version__
from fedskew.config import ConfigError, RunConfig
from fedskew.data.federated import build_federated
from fedskew.data.partition import PartitionError, train_test_split_clients
from fedskew.data.pools import ClientData, FederatedData, input_shape, to_float
from fedskew.data.readers.base import cache_root
from fedskew.flower.settings import NODE_DATA
from fedskew.seeding import Purpose, numpy_rng

log = logging.getLogger("flwr.fedskew")
_FIELDS = ("x_train", "y_train", "x_test", "y_test", "x_val", "y_val")


@dataclass(frozen=True)
class NodePart:
    """One client's data and what the model needs to know of the dataset (its classes and input shape)."""

    name: str
    num_classes: int
    in_channels: int
    image_size: int
    client: ClientData
    vocabulary: str = ""  # text: a hash of the token ids' words (every node must share them), "" for images

    def federation(self) -> FederatedData:
        """A federation holding only this client (what the engine's model and training code read of the data)."""
        c = self.client
        empty_x, empty_y = c.x_test[:0], c.y_test[:0]
        hist = np.bincount(c.y_train.cpu().numpy(), minlength=self.num_classes)[None, :]
        return FederatedData(
            name=self.name,
            num_classes=self.num_classes,
            in_channels=self.in_channels,
            image_size=self.image_size,
            clients=[c],
            x_test=empty_x,
            y_test=empty_y,
            train_hists=hist,
            test_hists=np.zeros_like(hist),
            local_x=empty_x,
            local_y=empty_y,
            local_owner=torch.zeros(0, dtype=torch.long, device=empty_y.device),
        )

    @property
    def train_hist(self) -> np.ndarray:
        return np.bincount(self.client.y_train.cpu().numpy(), minlength=self.num_classes).astype(np.int64)


def cache_dir(node_config: dict[str, Any] | None = None) -> Path | None:
    """Where this node caches its parts: its ``cache-dir``, else fedskew's cache (``$FEDSKEW_CACHE``; None: off)."""
    explicit = (node_config or {}).get("cache-dir") or (node_config or {}).get("cache_dir")
    return Path(str(explicit)) if explicit else cache_root()


def part_key(cfg: RunConfig, cid: int) -> str:
    """A hash of everything that decides client ``cid``'s part: the data settings, the id and fedskew's version."""
    settings = dataclasses.asdict(cfg.data_settings())
    settings.pop("device", None)  # where the tensors go is not what they are
    blob = json.dumps({"data": settings, "cid": cid, "fedskew": __version__}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _save(path: Path, part: NodePart) -> None:
    """Write the part atomically: a temporary file in the same folder, renamed over the target when complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    c = part.client
    payload: dict[str, Any] = {
        "meta": [part.name, part.num_classes, part.in_channels, part.image_size, c.cid, part.vocabulary],
        **{f: getattr(c, f).cpu() for f in _FIELDS if getattr(c, f) is not None},
    }
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(payload, fh)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _load(path: Path, device: str) -> NodePart | None:
    try:
        payload = torch.load(path, map_location=device, weights_only=True)
        name, num_classes, in_channels, image_size, cid, vocabulary = payload["meta"]
        tensors = {f: payload.get(f) for f in _FIELDS}
        client = ClientData(int(cid), **tensors)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a damaged cache file is rebuilt, whatever is wrong with it
        return None
    return NodePart(str(name), int(num_classes), int(in_channels), int(image_size), client, str(vocabulary))


def cached_part(cfg: RunConfig, cid: int, node_config: dict[str, Any] | None = None) -> NodePart:
    """Client ``cid``'s part of the simulator's partition of ``cfg``'s dataset, from this node's cache (built, kept
    to the one client and cached on the first call)."""
    root = cache_dir(node_config)
    path = None if root is None else root / "parts" / f"{part_key(cfg, cid)}.pt"
    if path is not None and path.is_file():
        part = _load(path, cfg.device)
        if part is not None and part.client.cid == cid:
            return part
    data = build_federated(cfg)
    if cid >= data.num_clients:
        raise ConfigError(f"this node is client {cid}, but the federation has clients 0..{data.num_clients - 1}")
    part = NodePart(
        data.name,
        data.num_classes,
        data.in_channels,
        data.image_size,
        data.clients[cid],
        vocabulary_hash(data.vocabulary),
    )
    del data
    if path is not None:
        try:
            _save(path, part)
        except OSError as exc:  # a read-only cache costs time, not correctness
            log.warning("fedskew: cannot cache client %d's part in %s (%s)", cid, path.parent, exc)
    return part


def own_part(cfg: RunConfig, cid: int) -> NodePart:
    """The node's own data (``flower.data = node``): every sample of the reader's source in the node's
    ``data_dir`` is this client's; its test split is the files' (or ``train_ratio`` of its samples), its validation
    split ``cfg.validation`` of its training samples (module docstring)."""
    from fedskew.data.federated import reader_options
    from fedskew.data.readers.base import ClientDatasets
    from fedskew.data.readers.registry import load_source

    if cfg.data_dir in (None, NODE_DATA):
        raise ConfigError(
            "flower.data = node: this node has no data directory; start its SuperNode with "
            "--node-config \"cid=K data-dir='/path/to/its/data'\""
        )
    src = load_source(cfg.dataset, cfg.data_dir, download=False, **reader_options(cfg))
    if isinstance(src, ClientDatasets):
        raise ConfigError(
            f"{cfg.data_dir}: holds per-client files ({src.num_clients} clients); a node's data directory holds "
            "only its own data (one .npz with x, y, x_test, y_test, or an image folder)"
        )
    dev = torch.device(cfg.device)
    x, y = src.x_train, np.asarray(src.y_train, dtype=np.int64)
    if src.x_test is not None and src.y_test is not None:
        x_test, y_test = src.x_test, np.asarray(src.y_test, dtype=np.int64)
    else:
        try:
            (tr,), (te,) = train_test_split_clients(
                [np.arange(len(y))], cfg.train_ratio, numpy_rng(cfg.federation_seed, Purpose.SPLIT, 4, cid)
            )
        except PartitionError as exc:
            raise PartitionError(f"{cfg.data_dir}: too few samples to split off a test split: {exc}") from None
        x, y, x_test, y_test = x[tr], y[tr], x[te], y[te]
    x_val = y_val = None
    if cfg.validation:
        try:
            (tr,), (va,) = train_test_split_clients(
                [np.arange(len(y))], 1.0 - cfg.validation, numpy_rng(cfg.federation_seed, Purpose.SPLIT, 5, cid)
            )
        except PartitionError as exc:
            raise PartitionError(f"validation={cfg.validation}: {cfg.data_dir} is too small to carve: {exc}") from None
        x_val, y_val = to_float(x[va], dev), torch.from_numpy(y[va]).to(dev)
        x, y = x[tr], y[tr]
    if cfg.evaluate_on == "validation":
        if x_val is None:
            raise ConfigError("evaluate_on 'validation' needs validation splits: set validation to a share in (0, 1)")
        x_test_t, y_test_t = x_val, y_val
    else:
        x_test_t, y_test_t = to_float(x_test, dev), torch.from_numpy(y_test).to(dev)
    client = ClientData(
        cid, to_float(x, dev), torch.from_numpy(y).to(dev), x_test_t, y_test_t, x_val=x_val, y_val=y_val
    )
    vocabulary = tuple(getattr(src, "vocabulary", ()) or ())
    in_channels, image_size = input_shape(x, len(vocabulary))
    return NodePart(src.name, src.num_classes, in_channels, image_size, client, vocabulary_hash(vocabulary))  # type: ignore[arg-type]


def vocabulary_hash(vocabulary: tuple[str, ...]) -> str:
    """A short hash of a text dataset's vocabulary (the word of every token id); "" for images."""
    if not vocabulary:
        return ""
    return hashlib.sha256("\n".join(vocabulary).encode()).hexdigest()[:16]
