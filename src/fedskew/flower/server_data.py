"""What a Flower server holds: a test set at most (the dataset's global test split in a simulated deployment, its
``test_data`` or nothing in a real federation) and, per client, an empty placeholder; what it knows of the clients'
data is what they reported (:mod:`fedskew.flower.hello`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.config import ConfigError, RunConfig
from fedskew.data.pools import ClientData, FederatedData, to_float
from fedskew.engine.evaluate import domain_summary
from fedskew.flower.hello import NodeReport
from fedskew.protocol import ClientScores


def server_view(full: FederatedData | None, reports: dict[int, NodeReport], cfg: RunConfig, test: Any) -> FederatedData:
    """What the server holds: a test set (the dataset's global test split in a simulated deployment; under
    ``flower.data = node`` its ``test_data``, or none) and per client nothing but an empty placeholder; what it
    knows of the clients' data is :func:`known_of`."""
    n = len(reports)
    first = reports[0]
    if full is not None:
        x_test, y_test, name, domains = full.x_test, full.y_test, full.name, full
    else:
        dev = torch.device(cfg.device)
        if test is None and first.tokens:  # text: token ids [N, L]
            x_test = torch.zeros((0, first.image_size), dtype=torch.long, device=dev)
            y_test = torch.zeros(0, dtype=torch.long, device=dev)
        elif test is None:
            x_test = torch.zeros((0, first.in_channels, first.image_size, first.image_size), device=dev)
            y_test = torch.zeros(0, dtype=torch.long, device=dev)
        else:
            x_test, y_test = to_float(test[0], dev), torch.from_numpy(np.asarray(test[1], dtype=np.int64)).to(dev)
        name, domains = cfg.dataset, None
    ex, ey = x_test[:0], y_test[:0]
    clients = [ClientData(c, ex, ey, ex, ey) for c in range(n)]
    owner = torch.zeros(0, dtype=torch.long, device=ey.device)
    unknown = np.zeros((n, first.num_classes), dtype=np.int64)  # the server never learns the clients' histograms
    view = FederatedData(
        name=name,
        num_classes=first.num_classes,
        in_channels=first.in_channels,
        image_size=first.image_size,
        clients=clients,
        x_test=x_test,
        y_test=y_test,
        train_hists=unknown,
        test_hists=unknown,
        local_x=ex,
        local_y=ey,
        local_owner=owner,
    )
    named = sorted({r.domain for r in reports.values()} - {""})
    if full is None and named:  # a real federation whose nodes say which domain they hold (node config `domain`)
        lacking = sorted(c for c, r in reports.items() if not r.domain)
        if lacking:
            raise ConfigError(f"nodes of clients {lacking} name no domain while others do (node config domain=NAME)")
        index = {d: i for i, d in enumerate(named)}
        view = dataclasses.replace(
            view,
            domains=tuple(named),
            client_domain=np.array([index[reports[c].domain] for c in range(n)], dtype=np.int64),
        )
    if domains is not None and domains.domains:
        view = dataclasses.replace(
            view,
            domains=domains.domains,
            client_domain=domains.client_domain,
            test_domain=domains.test_domain,
            test_index=domains.test_index,
        )
    return view


def load_test_data(path: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """The server's held-out test set (``flower.test_data``): an ``.npz`` with ``x_test``/``y_test`` (or ``x``/``y``),
    checked as every npz the npz reader reads."""
    from fedskew.data.readers.npz import check_images, check_labels

    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"flower.test_data: {file} does not exist (an .npz with x_test, y_test or x, y)")
    try:
        with np.load(file, allow_pickle=False) as z:
            keys = ("x_test", "y_test") if "x_test" in z.files else ("x", "y")
            if not set(keys) <= set(z.files):
                raise ConfigError(f"flower.test_data: {file} holds {sorted(z.files)}, expected x_test, y_test or x, y")
            x, y = z[keys[0]], z[keys[1]]
    except (OSError, ValueError) as exc:
        raise ConfigError(f"flower.test_data: {file} is not a readable .npz ({exc})") from None
    x = check_images(x, f"{file}:{keys[0]}")
    y = check_labels(y, len(x), f"{file}:{keys[1]}", num_classes)
    return x, y


def domain_scores(domains: tuple[str, ...], client_domain: np.ndarray, scores: ClientScores) -> dict[str, float]:
    """Federated evaluation per domain: the global model's scores on the clients' test splits, pooled over the
    clients of each domain (``domain_acc/NAME``, ``domain_acc_avg``, ``domain_acc_std``, as FedHEAL reports them)."""
    k = len(domains)
    per = ClientScores(
        np.bincount(client_domain, weights=scores.correct, minlength=k),
        np.bincount(client_domain, weights=scores.loss_sum, minlength=k),
        np.bincount(client_domain, weights=scores.count, minlength=k),
    )
    return domain_summary(domains, per)
