"""Clients trained in worker processes give the sequential run's results exactly (engine/workers.py)."""

import json

import pytest
import torch

from fedskew.config import make_config
from fedskew.engine.workers import ClientWorkers, can_fork
from fedskew.runner import run_experiment

pytestmark = pytest.mark.skipif(can_fork("cpu") is not None, reason=str(can_fork("cpu")))


def _records(run_dir):
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in lines]


@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("fedavg", {}),
        ("scaffold+heal", {"join_ratio": 0.6}),  # client state (c_i) travels to the workers and back
        ("fedcac", {}),  # uploads (masks) and personalized models
        ("moon", {"client_dropout": 0.3}),
    ],
)
def test_workers_give_the_sequential_metrics(tmp_path, one_thread, method, extra):
    base = {"clients": 5, "rounds": 3, "method": method, "db": None, "seed": 2, "skew_probes": 0, **extra}
    run_experiment(make_config(None, {**base, "out": str(tmp_path / "seq")}))
    run_experiment(make_config(None, {**base, "out": str(tmp_path / "par"), "workers": 2}))
    assert _records(tmp_path / "par") == _records(tmp_path / "seq")
    assert torch.get_num_threads() == 1  # the parent's threads are left as they were


def test_workers_resume_exactly(tmp_path, one_thread):
    """Interrupted after round 2 with workers, resumed with workers: the sequential run's records."""
    base = {"clients": 4, "rounds": 4, "method": "scaffold", "db": None, "seed": 1, "skew_probes": 0}
    run_experiment(make_config(None, {**base, "out": str(tmp_path / "seq")}))

    class Stop(Exception):
        pass

    def stop_after_two(result):
        if result.record["round"] == 2:
            raise Stop

    cfg = make_config(None, {**base, "out": str(tmp_path / "par"), "workers": 2, "checkpoint_every": 1})
    with pytest.raises(Stop):
        run_experiment(cfg, on_round=stop_after_two)
    run_experiment(cfg, resume=True)
    assert _records(tmp_path / "par") == _records(tmp_path / "seq")


def test_worker_pool_trains_in_order_and_updates_client_state(one_thread):
    from conftest import digits_simulation

    seq, par = digits_simulation("scaffold"), digits_simulation("scaffold")
    jobs = [(c, seq.params_for(c), {}) for c in range(4)]
    expected = [seq._train(c, 1, r, b) for c, r, b in jobs]
    with ClientWorkers(par, 2) as pool:
        got = list(pool.train(par, 1, jobs))
    assert [u.cid for u in got] == [0, 1, 2, 3]
    for u, v in zip(expected, got, strict=True):
        assert all(torch.equal(u.params[k], v.params[k]) for k in u.params)
    for c in range(4):
        assert all(
            torch.equal(seq.client_states[c]["scaffold_ci"][k], par.client_states[c]["scaffold_ci"][k])
            for k in seq.client_states[c]["scaffold_ci"]
        )


def test_workers_refused_where_they_cannot_run():
    with pytest.raises(Exception, match="workers"):
        make_config(None, {"workers": 0})
    assert can_fork("meta") is not None


def test_batched_clients_setting_matches_the_sequential_run_and_falls_back_with_a_warning(tmp_path, one_thread):
    base = {"clients": 4, "rounds": 2, "db": None, "seed": 3, "skew_probes": 0, "method": "fedprox"}
    seq = run_experiment(make_config(None, {**base, "out": str(tmp_path / "s")})).records
    bat = run_experiment(make_config(None, {**base, "out": str(tmp_path / "b"), "batched_clients": True})).records
    for a, b in zip(seq, bat, strict=True):
        assert a["global_acc"] == pytest.approx(b["global_acc"], abs=2e-3)  # float32 rounding may flip a sample
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
    # MOON's term is written on the stacked graph only: on a ResNet it falls back to the sequential loop, saying why
    with pytest.warns(UserWarning, match="batched_clients: .*Moon's loss term"):
        over = {"method": "moon", "model": "resnet8", "rounds": 1, "batched_clients": True}
        run_experiment(make_config(None, {**base, **over, "out": str(tmp_path / "m")}))


def test_a_dead_worker_stops_the_round_with_an_error_not_a_hang(one_thread):
    import os

    from conftest import digits_simulation

    from fedskew.engine.workers import WorkerDied

    sim = digits_simulation("fedavg")
    train = sim._train

    def dies_on_client_2(cid, rnd, received, broadcast):
        if cid == 2:
            os._exit(3)  # as if killed by the OOM killer
        return train(cid, rnd, received, broadcast)

    sim._train = dies_on_client_2  # inherited by the forked workers
    jobs = [(c, sim.params_for(c), {}) for c in range(4)]
    with ClientWorkers(sim, 2) as pool, pytest.raises(WorkerDied, match="round 1: a worker process died"):
        list(pool.train(sim, 1, jobs))


def test_jobs_travel_as_bytes_without_a_descriptor_passing_thread(one_thread):
    """torch's shared-memory reducers start a resource_sharer thread in the sender; a later fork while it runs can
    deadlock (a CI run hung on it). The pool must leave the parent with no such thread."""
    import threading

    from conftest import digits_simulation

    sim = digits_simulation("scaffold")
    with ClientWorkers(sim, 2) as pool:
        list(pool.train(sim, 1, [(c, sim.params_for(c), {}) for c in range(3)]))
    assert not [t.name for t in threading.enumerate() if "_serve" in t.name]


@pytest.mark.parametrize(
    "value",
    [
        torch.arange(12.0).reshape(3, 4),
        torch.tensor(3.5),
        torch.zeros(0, 5),
        torch.tensor([True, False, True]),
        torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t(),  # not contiguous
        torch.nn.Parameter(torch.ones(2, 2)),
    ],
)
def test_transport_round_trips_tensors(value):
    from fedskew.engine.workers import pack, unpack

    got = unpack(pack({"x": value, "n": 3}))
    assert got["n"] == 3 and type(got["x"]) is type(value)
    assert got["x"].dtype == value.dtype and got["x"].shape == value.shape
    assert torch.equal(got["x"], value.detach())


def test_transport_sends_a_row_not_its_whole_stacked_buffer():
    from fedskew.engine.workers import pack

    stacked = torch.zeros(100, 1000)
    assert len(pack(stacked[3])) < 2 * 4 * 1000  # one row, not the 400 kB storage


def test_worker_evaluation_splits_passes_into_whole_batches_with_the_same_scores(one_thread):
    from conftest import digits_simulation

    from fedskew.engine.evaluate import batch_scores

    sim = digits_simulation("fedavg")
    sim.eval_batch = 7  # the client test splits are not multiples of it
    passes = [(sim.global_params, "local"), (sim.global_params, "test"), (sim.global_params, ("client", 2))]
    expected = []
    for params, source in passes:
        sim.model.load_state_dict(params)
        expected.append(batch_scores(sim.model, *sim.eval_tensors(source), 7))
    with ClientWorkers(sim, 3) as pool:
        got = pool.score(sim, passes, 7)
    assert [len(b) for b in got] == [len(b) for b in expected]
    for exp, out in zip(expected, got, strict=True):
        for (h1, l1), (h2, l2) in zip(exp, out, strict=True):
            assert torch.equal(h1, h2) and torch.equal(l1, l2)


def test_workers_give_the_sequential_metrics_under_domain_skew(tmp_path, one_thread, fake_domains):
    base = {
        "dataset": "digits_domains", "partition": "domain", "clients": 6, "domain_fraction": 0.1, "rounds": 2,
        "method": "fedavg+heal", "db": None, "seed": 4, "skew_probes": 0,
    }  # fmt: skip
    run_experiment(make_config(None, {**base, "out": str(tmp_path / "seq")}))
    run_experiment(make_config(None, {**base, "out": str(tmp_path / "par"), "workers": 2}))
    assert _records(tmp_path / "par") == _records(tmp_path / "seq")
