"""FPL (Huang et al., CVPR 2023; catalog/fpl.py): FINCH-clustered prototypes, the client's hierarchical loss, its
batched form, and both against ports of the official code (github.com/WenkeHuang/RethinkFL)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from sklearn.metrics import pairwise_distances
from test_batched_clients import _same_states, _same_updates, _side_by_side

from fedskew.catalog.fpl import (
    FPL_CLUSTERS,
    FPL_PRESENT,
    FPL_UNBIASED,
    FPL_VALID,
    FPLPrototypes,
    FPLServer,
    cluster_prototypes,
    finch,
    fpl_terms,
)
from fedskew.client.prototypes import PROTO_COUNT, PROTO_MEAN
from fedskew.methods import resolve_method
from fedskew.protocol import ServerContext, Upload
from fedskew.server.uploads import stack_uploads


# ---- a port of the official utils/finch.py (ensure_early_exit off, no req_clust) -----------------------------------
def _official_finch(data: np.ndarray) -> np.ndarray:
    data = data.astype(np.float32)

    def rank(mat):
        s = mat.shape[0]
        dist = pairwise_distances(mat, mat, metric="cosine")
        np.fill_diagonal(dist, 1e12)
        first = np.argmin(dist, axis=1)
        a = sp.csr_matrix((np.ones_like(first, dtype=np.float32), (np.arange(s), first)), shape=(s, s))
        a = a + sp.eye(s, dtype=np.float32, format="csr")
        a = (a @ a.T).tolil()
        a.setdiag(0)
        return sp.csgraph.connected_components(a, directed=True, connection="weak", return_labels=True)

    def merge(c, u):
        if len(c):
            _, ig = np.unique(c, return_inverse=True)
            c = u[ig]
        else:
            c = u
        un, nf = np.unique(c, return_counts=True)
        umat = sp.csr_matrix((np.ones(len(c), dtype="float32"), (np.arange(len(c)), c)), shape=(len(c), len(un)))
        return c, (umat.T @ data) / nf[:, None]

    num, group = rank(data)
    c, mat = merge([], group)
    parts, counts, c_, exit_clust = [c], [num], c, 2
    while exit_clust > 1:
        num_curr, u = rank(mat)
        c_, mat = merge(c_, u)
        counts.append(num_curr)
        parts.append(c_)
        exit_clust = counts[-2] - num_curr
        if num_curr == 1 or exit_clust < 1:
            parts.pop()
            break
    return parts[-1]


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    return bool((np.equal.outer(a, a) == np.equal.outer(b, b)).all())


@pytest.mark.parametrize("seed", range(6))
def test_finch_keeps_the_official_implementations_partition(seed):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(rng.integers(2, 6), 8)) * 3
    points = np.concatenate([c + rng.normal(size=(rng.integers(1, 7), 8)) for c in centres])
    assert _same_partition(finch(points), _official_finch(points))


def test_two_prototypes_are_one_cluster_and_one_stays_itself():
    protos = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert np.allclose(cluster_prototypes(protos), [[0.5, 0.5]])
    assert np.allclose(cluster_prototypes(protos[:1]), protos[:1])


# ---- the client's loss -------------------------------------------------------------------------------------------
def _official_loss(f, labels, all_f, mean_f, keys, tau):
    """models/fpl.py's per-sample hierarchical_info_loss, summed and divided by the batch size."""
    total = None
    for i, label in enumerate(labels):
        if label.item() not in keys:
            continue
        f_now = f[i].unsqueeze(0)
        f_pos = all_f[keys.index(label.item())]
        f_neg = torch.cat([all_f[j] for j, k in enumerate(keys) if k != label.item()])
        l_ = torch.cosine_similarity(f_now, torch.cat((f_pos, f_neg)), dim=1) / tau
        e = torch.exp(l_).view(1, -1)
        mask = torch.tensor([1.0] * f_pos.shape[0] + [0.0] * f_neg.shape[0]).view(1, -1)
        info = -torch.log((e * mask).sum(1) / e.sum(1))
        mse = torch.nn.MSELoss()(f_now, mean_f[keys.index(label.item())].view(1, -1))
        total = info + mse if total is None else total + info + mse
    return total / len(labels)


def test_the_hierarchical_loss_is_the_official_codes():
    g = torch.Generator().manual_seed(0)
    c, d, tau = 4, 6, 0.1
    per_class = {k: torch.randn(n, d, generator=g) for k, n in ((0, 3), (1, 1), (3, 2))}
    m = max(p.shape[0] for p in per_class.values())
    clusters, valid = torch.zeros(c, m, d), torch.zeros(c, m, dtype=torch.bool)
    unbiased, present = torch.zeros(c, d), torch.zeros(c, dtype=torch.bool)
    for k, p in per_class.items():
        clusters[k, : p.shape[0]], valid[k, : p.shape[0]], unbiased[k], present[k] = p, True, p.mean(0), True
    f = torch.randn(10, d, generator=g)
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 0])  # class 2 has no prototypes: no term for its samples
    ours = fpl_terms(f, y, FPLPrototypes(clusters, valid, unbiased, present), tau).sum() / len(y)
    keys = sorted(per_class)
    theirs = _official_loss(f, y, [per_class[k] for k in keys], [per_class[k].mean(0) for k in keys], keys, tau)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-5)


# ---- the server half and the composition ---------------------------------------------------------------------------
def test_the_server_half_clusters_each_classs_round_prototypes():
    d = 3
    mean = torch.zeros(3, 2, d)
    mean[:, 0] = torch.tensor([[1.0, 0, 0], [0.9, 0.1, 0], [0, 0, 1.0]])
    count = torch.tensor([[5.0, 0.0], [3.0, 0.0], [2.0, 0.0]])  # class 1: no client holds it
    ups = [Upload(i, {"w": torch.zeros(1)}, 10, extras={PROTO_MEAN: mean[i], PROTO_COUNT: count[i]}) for i in range(3)]
    rin = stack_uploads(ups, rnd=1, global_params={"w": torch.zeros(1)}, trainable=frozenset({"w"}))
    half = FPLServer()
    state = half.advance(rin, half.init(ServerContext(3, 2, {"w": torch.zeros(1)}, frozenset({"w"}), np.ones(3))))
    out = half.broadcast(state)
    want = cluster_prototypes(mean[:, 0].numpy())
    assert out[FPL_PRESENT].tolist() == [True, False]
    assert int(out[FPL_VALID][0].sum()) == want.shape[0]
    assert torch.allclose(out[FPL_CLUSTERS][0, : want.shape[0]], torch.from_numpy(want).float())
    assert torch.allclose(out[FPL_UNBIASED][0], torch.from_numpy(want.mean(0)).float())


def test_batched_equals_sequential_and_it_composes():
    seq, bat, rounds = _side_by_side("fpl", rounds=2)
    for _, _, ups_seq, ups_bat in rounds:
        _same_updates(ups_seq, ups_bat)
    _same_states(seq.client_states, bat.client_states)
    assert FPL_CLUSTERS in seq.server_half_state.broadcast  # round 2 trained against prototypes
    for name in ("fpl+heal", "fpl+disco"):
        assert resolve_method(name, {}).server_half is not None
