"""Faulty and unreliable clients: ``on_bad_update`` (fail | drop) and ``client_dropout``."""

import copy
import dataclasses
import json
import math
import sqlite3

import numpy as np
import pytest
import torch

import fedskew.engine.round_server as round_server  # where a round samples and draws its drop-outs
import fedskew.engine.rounds as rounds  # where a client's step calls local_train
from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.engine.loop import Diverged, Simulation, dropped_out, sample_clients
from fedskew.protocol import TIMING_KEYS, NonFiniteUploadError, Upload, UploadError
from fedskew.server.uploads import check_upload, stack_uploads, validate_uploads


def _cfg(tmp_path, **kw):
    values = {"clients": 5, "rounds": 3, "out": str(tmp_path / "run"), "db": None, "skew_probes": 0}
    values.update(kw)
    return make_config(None, values)


def _first_float(params):
    return next(n for n, t in params.items() if t.is_floating_point())


def _nan(params):
    n = _first_float(params)
    return {**params, n: torch.full_like(params[n], float("nan"))}


def _wrong_dtype(params):
    n = _first_float(params)
    return {**params, n: params[n].double()}


def _wrong_shape(params):
    n = _first_float(params)
    return {**params, n: params[n].reshape(-1)[:-1].clone()}


def _missing(params):
    return {k: v for k, v in list(params.items())[1:]}


def _unknown(params):
    return {**params, "intruder": torch.zeros(3)}


CORRUPTIONS = {
    "nan": (_nan, "NaN or Inf"),
    "dtype": (_wrong_dtype, "dtype torch.float64"),
    "shape": (_wrong_shape, "has shape"),
    "missing": (_missing, "missing tensors"),
    "unknown": (_unknown, "unknown tensors ['intruder']"),
}


def _corrupt_uploads(monkeypatch, corrupt, bad_clients):
    """Wrap the engine's local training: the uploads of ``bad_clients`` are corrupted after training."""
    real = rounds.local_train

    def faulty(algo, ctx, *args, **kwargs):
        update = real(algo, ctx, *args, **kwargs)
        if ctx.cid in bad_clients:
            return dataclasses.replace(update, params=corrupt(update.params))
        return update

    monkeypatch.setattr(rounds, "local_train", faulty)


def _without_clients(monkeypatch, excluded):
    """The reference: the same round with ``excluded`` never sampled."""
    real = round_server.sample_clients
    monkeypatch.setattr(round_server, "sample_clients", lambda *a: [c for c in real(*a) if c not in excluded])


def _same_params(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# ---- on_bad_update = drop --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_drop_excludes_a_bad_upload_logs_it_and_equals_the_round_without_it(tmp_path, monkeypatch, kind):
    corrupt, reason = CORRUPTIONS[kind]
    cfg = _cfg(tmp_path, on_bad_update="drop")
    data = build_federated(cfg)
    with monkeypatch.context() as m:
        _corrupt_uploads(m, corrupt, {2})
        sim = Simulation(cfg, data)
        rec = sim.round(1).record
    assert rec["participants"] == 4 and rec["sampled"] == 5
    assert [d["client"] for d in rec["dropped"]] == [2]
    assert reason in rec["dropped"][0]["reason"] and "client 2" not in rec["dropped"][0]["reason"]
    with monkeypatch.context() as m:
        _without_clients(m, {2})
        ref = Simulation(cfg, data)
        ref_rec = ref.round(1).record
    assert _same_params(sim.global_params, ref.global_params)
    assert rec["train_loss"] == ref_rec["train_loss"] and rec["global_acc"] == ref_rec["global_acc"]
    assert rec["diagnostics"] == ref_rec["diagnostics"]  # e.g. the weights over the 4 accepted clients


@pytest.mark.parametrize("method", ["scaffold+heal", "fedcac"])
def test_dropped_upload_does_not_advance_server_side_state(tmp_path, monkeypatch, method):
    """SCAFFOLD's control variate, HEAL's tables and FedCAC's personal models ignore the dropped client; the client
    itself keeps the local state it trained (it does not learn that the server ignored it)."""
    cfg = _cfg(tmp_path, method=method, on_bad_update="drop", rounds=2)
    data = build_federated(cfg)
    with monkeypatch.context() as m:
        _corrupt_uploads(m, _nan, {1})
        sim = Simulation(cfg, data)
        for r in (1, 2):
            assert [d["client"] for d in sim.round(r).record["dropped"]] == [1]
    with monkeypatch.context() as m:
        _without_clients(m, {1})
        ref = Simulation(cfg, data)
        for r in (1, 2):
            ref.round(r)
    assert _same_params(sim.global_params, ref.global_params)
    if method == "scaffold+heal":
        assert all(torch.equal(sim.server_half_state.c[n], t) for n, t in ref.server_half_state.c.items())
        assert 1 not in sim.server_state.masking and 1 not in sim.server_state.weighting.clients
        assert "scaffold_ci" in sim.client_states[1]  # the client's own control variate did advance
    else:
        assert 1 not in sim.personal and set(sim.personal) == set(ref.personal)
        assert all(_same_params(sim.personal[c], ref.personal[c]) for c in ref.personal)


def test_round_without_a_valid_upload_keeps_every_model(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, method="fedcac", on_bad_update="drop")
    sim = Simulation(cfg, build_federated(cfg))
    sim.round(1)
    before = copy.deepcopy((sim.global_params, sim.personal))
    server_state, server_half_state = sim.server_state, sim.server_half_state
    _corrupt_uploads(monkeypatch, _wrong_dtype, set(range(5)))
    rec = sim.round(2).record
    assert rec["participants"] == 0 and len(rec["dropped"]) == 5
    assert rec["skipped_aggregation"] == "no valid upload"
    assert rec["train_loss"] is None and "diagnostics" not in rec
    assert _same_params(sim.global_params, before[0])
    assert all(_same_params(sim.personal[c], before[1][c]) for c in before[1])
    assert sim.server_state is server_state and sim.server_half_state is server_half_state
    assert math.isfinite(rec["global_acc"])  # still evaluated on the cadence


def test_dropped_uploads_reach_metrics_and_database(tmp_path, monkeypatch):
    from fedskew.runner import run_experiment

    _corrupt_uploads(monkeypatch, _nan, {3})
    db = tmp_path / "r.db"
    cfg = _cfg(tmp_path, on_bad_update="drop", rounds=2, db=str(db))
    run_experiment(cfg)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [[d["client"] for d in r["dropped"]] for r in lines] == [[3], [3]]
    with sqlite3.connect(db) as conn:
        rows = [json.loads(m) for (m,) in conn.execute("SELECT metrics FROM rounds ORDER BY round")]
    assert [r["dropped"][0]["client"] for r in rows] == [3, 3]
    assert "NaN or Inf" in rows[0]["dropped"][0]["reason"]


# ---- on_bad_update = fail (the default): today's errors --------------------------------------------------------------
def test_fail_is_the_default_and_a_nan_upload_is_divergence(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    assert cfg.on_bad_update == "fail"
    _corrupt_uploads(monkeypatch, _nan, {2})
    sim = Simulation(cfg, build_federated(cfg))
    with pytest.raises(Diverged, match="client 2: tensor .* contains NaN or Inf"):
        sim.round(1)


@pytest.mark.parametrize("kind", ["dtype", "shape", "missing", "unknown"])
def test_fail_refuses_a_malformed_upload_naming_the_client(tmp_path, monkeypatch, kind):
    corrupt, reason = CORRUPTIONS[kind]
    _corrupt_uploads(monkeypatch, corrupt, {4})
    cfg = _cfg(tmp_path)
    sim = Simulation(cfg, build_federated(cfg))
    with pytest.raises(UploadError, match=f"client 4: .*{reason.split()[0]}") as err:
        sim.round(1)
    assert not isinstance(err.value, NonFiniteUploadError)


def test_fail_reports_a_malformed_upload_before_a_nonfinite_one(tmp_path, monkeypatch):
    real = rounds.local_train

    def faulty(algo, ctx, *args, **kwargs):
        u = real(algo, ctx, *args, **kwargs)
        return dataclasses.replace(u, params={0: _nan, 3: _wrong_dtype}.get(ctx.cid, dict)(u.params))

    monkeypatch.setattr(rounds, "local_train", faulty)
    cfg = _cfg(tmp_path)
    with pytest.raises(UploadError, match="client 3: tensor .* has dtype"):
        Simulation(cfg, build_federated(cfg)).round(1)


# ---- the one validation function -------------------------------------------------------------------------------------
GLOBAL = {"w": torch.zeros(2, 2), "n": torch.tensor(0)}


def _up(cid, w, n=5, **extras):
    return Upload(cid, {"w": w, "n": torch.tensor(1)}, n, extras=extras)


def test_validate_updates_splits_valid_and_rejected_with_reasons():
    ups = [
        _up(0, torch.ones(2, 2), m=torch.ones(3)),
        _up(1, torch.full((2, 2), float("inf")), m=torch.ones(3)),
        _up(2, torch.ones(4), m=torch.ones(3)),
        _up(3, torch.ones(2, 2), n=0, m=torch.ones(3)),
        _up(4, torch.ones(2, 2), m=torch.ones(4)),
        _up(5, torch.ones(2, 2)),
        _up(6, torch.ones(2, 2), m=torch.tensor([1.0, float("nan"), 0.0])),
        _up(7, 2 * torch.ones(2, 2), m=torch.ones(3)),
    ]
    valid, rejected = validate_uploads(ups, GLOBAL)
    assert [u.cid for u in valid] == [0, 7]
    reasons = {r.cid: r.reason for r in rejected}
    assert list(reasons) == [1, 2, 3, 4, 5, 6]
    assert "tensor 'w' contains NaN or Inf" in reasons[1]
    assert "shape (4,)" in reasons[2] and "num_samples" in reasons[3]
    assert "extra tensor 'm'" in reasons[4] and "extras [] differ" in reasons[5]
    assert "extra tensor 'm' contains NaN or Inf" in reasons[6]
    assert [r.nonfinite for r in rejected] == [True, False, False, False, False, True]
    assert check_upload(ups[0], GLOBAL) is None


def test_stack_updates_drop_equals_stacking_the_valid_ones():
    ups = [_up(0, torch.ones(2, 2)), _up(1, torch.full((2, 2), float("nan"))), _up(2, 3 * torch.ones(2, 2), n=15)]
    hists = np.array([[1, 0], [0, 1], [2, 2]])
    kw = {"rnd": 1, "global_params": GLOBAL, "trainable": frozenset({"w"})}
    rin = stack_uploads(ups, label_hists=hists, on_bad_update="drop", **kw)
    ref = stack_uploads([ups[0], ups[2]], label_hists=hists[[0, 2]], **kw)
    assert rin.cids == (0, 2) and [r.as_record()["client"] for r in rin.rejected] == [1]
    assert torch.equal(rin.params["w"], ref.params["w"]) and torch.equal(rin.num_samples, ref.num_samples)
    assert np.array_equal(rin.label_hists, ref.label_hists)
    with pytest.raises(NonFiniteUploadError, match="client 1"):
        stack_uploads(ups, label_hists=hists, **kw)
    with pytest.raises(UploadError, match="no valid upload"):
        stack_uploads([ups[1]], label_hists=hists[:1], on_bad_update="drop", **kw)


# ---- client_dropout --------------------------------------------------------------------------------------------------
def test_dropout_is_seeded_per_round_and_client_and_only_removes_sampled_clients():
    for rnd in range(1, 30):
        sampled = sample_clients(3, rnd, 20, 0.5)
        gone = dropped_out(3, rnd, sampled, 20, 0.5)
        assert gone == dropped_out(3, rnd, sampled, 20, 0.5) and set(gone) <= set(sampled)
        assert set(dropped_out(3, rnd, sampled, 20, 0.2)) <= set(gone)  # a larger p only removes more
        everyone = dropped_out(3, rnd, list(range(20)), 20, 0.5)
        assert gone == [c for c in everyone if c in sampled]  # a client's fate does not depend on who else is sampled
    assert dropped_out(3, 1, list(range(20)), 20, 0.0) == []
    rates = [len(dropped_out(0, r, list(range(100)), 100, 0.3)) / 100 for r in range(1, 51)]
    assert 0.25 < np.mean(rates) < 0.35


def test_dropout_records_and_sampling_unchanged(tmp_path):
    cfg = _cfg(tmp_path, clients=8, join_ratio=0.5, rounds=6, client_dropout=0.5, seed=4)
    sim = Simulation(cfg, build_federated(cfg))
    for rnd in range(1, 7):
        rec = sim.round(rnd).record
        sampled = sample_clients(4, rnd, 8, 0.5)  # the same clients as without dropout
        assert rec["sampled"] == len(sampled) and set(rec["dropped_out"]) <= set(sampled)
        assert rec["participants"] == len(sampled) - len(rec["dropped_out"])
    assert "dropped_out" not in Simulation(_cfg(tmp_path), build_federated(_cfg(tmp_path))).round(1).record


def _strip(rec):
    return {k: v for k, v in rec.items() if k not in TIMING_KEYS}


@pytest.mark.parametrize("method", ["scaffold", "heal", "fedamp", "fedcac", "ditto"])
def test_stateful_methods_with_dropout_are_finite_reproducible_and_leave_absent_clients_alone(tmp_path, method):
    cfg = _cfg(tmp_path, method=method, clients=6, rounds=5, client_dropout=0.5, seed=1, dataset="digits")
    data = build_federated(cfg)
    runs = []
    saw_dropout = False
    for _ in range(2):
        sim = Simulation(cfg, data)
        records = []
        for rnd in range(1, 6):
            states = {c: dict(s) for c, s in sim.client_states.items()}  # entries are replaced, never mutated
            trained, personal = dict(sim.trained), dict(sim.personal)
            rec = sim.round(rnd).record
            records.append(_strip(rec))
            for cid in rec["dropped_out"]:
                saw_dropout = True
                assert sim.client_states[cid].keys() == states[cid].keys()
                assert all(sim.client_states[cid][k] is v for k, v in states[cid].items()), (method, rnd, cid)
                assert sim.trained.get(cid) is trained.get(cid) and sim.personal.get(cid) is personal.get(cid)
            assert all(torch.isfinite(t).all() for t in sim.global_params.values() if t.is_floating_point())
        runs.append((records, sim.global_params))
    assert saw_dropout
    assert json.dumps(runs[0][0], sort_keys=True) == json.dumps(runs[1][0], sort_keys=True)
    assert _same_params(runs[0][1], runs[1][1])
    assert all(math.isfinite(r["global_acc"]) for r in runs[0][0])


def test_round_where_everyone_drops_out_keeps_the_model(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, method="scaffold", client_dropout=0.5)
    sim = Simulation(cfg, build_federated(cfg))
    sim.round(1)
    before = copy.deepcopy(sim.global_params)
    server_half_state = sim.server_half_state
    monkeypatch.setattr(round_server, "dropped_out", lambda seed, rnd, sampled, n, p: list(sampled))
    rec = sim.round(2).record
    assert rec["skipped_aggregation"] == "every sampled client dropped out"
    assert rec["participants"] == 0 and rec["train_loss"] is None and rec["bytes_up"] == 0
    assert _same_params(sim.global_params, before) and sim.server_half_state is server_half_state


def test_one_fail_policy_for_a_list_and_for_the_engine(tmp_path, monkeypatch):
    """Issue 32: `stack_uploads` (a list of uploads: the Flower strategies) and the engine (uploads one by one) raise
    the same error under `fail`: the round's first malformed upload's, even after a non-finite one; a round with only
    non-finite uploads raises the non-finite error (the engine: divergence)."""
    from fedskew.server.uploads import enforce

    ups = [_up(0, torch.full((2, 2), float("nan"))), _up(1, torch.ones(3)), _up(2, torch.ones(2, 2))]
    with pytest.raises(UploadError, match="client 1: tensor 'w' has shape") as got:
        stack_uploads(ups, rnd=1, global_params=GLOBAL, trainable=frozenset({"w"}))
    assert not isinstance(got.value, NonFiniteUploadError)
    with pytest.raises(NonFiniteUploadError, match="client 0"):
        stack_uploads(ups[:1] + ups[2:], rnd=1, global_params=GLOBAL, trainable=frozenset({"w"}))
    rin = stack_uploads(ups, rnd=1, global_params=GLOBAL, trainable=frozenset({"w"}), on_bad_update="drop")
    assert rin.cids == (2,) and [r.cid for r in rin.rejected] == [0, 1]
    with pytest.raises(ValueError, match="on_bad_update"):
        enforce([], "ignore")

    real = rounds.local_train

    def faulty(algo, ctx, *args, **kwargs):  # client 0 uploads NaN, client 2 a mis-shaped tensor
        up = real(algo, ctx, *args, **kwargs)
        if ctx.cid in (0, 2):
            bad = {k: v.clone() for k, v in up.params.items()}
            name = next(k for k, v in bad.items() if v.is_floating_point())
            bad[name] = torch.full_like(bad[name], float("nan")) if ctx.cid == 0 else bad[name].flatten()
            up = dataclasses.replace(up, params=bad)
        return up

    monkeypatch.setattr(rounds, "local_train", faulty)
    cfg = _cfg(tmp_path)
    with pytest.raises(UploadError, match="client 2: tensor .* has shape") as got:
        Simulation(cfg, build_federated(cfg)).round(1)
    assert not isinstance(got.value, Diverged)


@pytest.mark.parametrize("kind", ["nan", "shape"])
def test_streaming_drops_a_bad_upload_before_summing_it(tmp_path, monkeypatch, kind):
    """Streaming aggregation (server/streaming.py) validates each upload before adding it to the running sums: a
    dropped one leaves the round equal to the round without it, as the stacked path does."""
    corrupt, reason = CORRUPTIONS[kind]
    cfg = _cfg(tmp_path, method="scaffold", on_bad_update="drop", aggregation="streaming")
    data = build_federated(cfg)
    with monkeypatch.context() as m:
        _corrupt_uploads(m, corrupt, {3})
        sim = Simulation(cfg, data)
        rec = sim.round(1).record
    assert rec["aggregation"] == "streaming" and rec["participants"] == 4
    assert [d["client"] for d in rec["dropped"]] == [3] and reason in rec["dropped"][0]["reason"]
    with monkeypatch.context() as m:
        _without_clients(m, {3})
        ref = Simulation(cfg, data)
        ref.round(1)
    assert _same_params(sim.global_params, ref.global_params)
    assert all(torch.equal(sim.server_half_state.c[n], t) for n, t in ref.server_half_state.c.items())
    fail = _cfg(tmp_path / "fail", method="scaffold", aggregation="streaming")
    with monkeypatch.context() as m:
        _corrupt_uploads(m, corrupt, {3})
        with pytest.raises(Exception, match="client 3" if kind == "shape" else "NaN|Inf|diverged"):
            Simulation(fail, build_federated(fail)).round(1)


@pytest.mark.parametrize("policy", ["fail", "drop"])
def test_batched_clients_uploads_checked_together_are_judged_as_one_by_one(tmp_path, monkeypatch, policy):
    # batched clients' uploads arrive together and are checked for NaN/Inf in one multi-tensor norm: a bad one is
    # still named, dropped or divergence, and a malformed one still reported before a non-finite one
    import fedskew.engine.backends as backends

    real = backends.BatchedClients.train

    def faulty(self, host, rnd, jobs):
        corrupt = {0: _nan, 2: _nan, 3: _wrong_dtype}
        return [dataclasses.replace(u, params=corrupt.get(u.cid, dict)(u.params)) for u in real(self, host, rnd, jobs)]

    monkeypatch.setattr(backends.BatchedClients, "train", faulty)
    cfg = _cfg(tmp_path, batched_clients=True, on_bad_update=policy)
    sim = Simulation(cfg, build_federated(cfg))
    if policy == "fail":
        with pytest.raises(UploadError, match="client 3: tensor .* has dtype"):
            sim.round(1)
        return
    record = sim.round(1).record
    assert [d["client"] for d in record["dropped"]] == [0, 2, 3] and record["participants"] == 2
    assert ["NaN or Inf" in d["reason"] for d in record["dropped"]] == [True, True, False]
