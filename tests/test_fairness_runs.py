"""Issue 14: whole runs of the FedHEAL paper's comparisons (FedProto and FedProc hosts, the AFL, q-FFL and FedFV
server plug-ins): ``fedproto+heal`` with HEAL switched off equal to ``fedproto``, short runs that learn, the
prototype views per domain, exact resume of the stateful ones, and the loss-before wrapper's hook forwarding."""

import numpy as np
import pytest
import torch
from conftest import digits_simulation, fake_domains_config, same_params, without_timing

import fedskew.data.federated as fed
from fedskew.catalog.prototypes import FedProto
from fedskew.client.loss_before import LossAfter, LossBefore
from fedskew.engine.checkpoint import capture, restore
from fedskew.engine.loop import Simulation


# ---- hosts -----------------------------------------------------------------------------------------------------
def test_fedproto_with_heal_switched_off_equals_fedproto(one_thread):
    # HEAL with FPHL disabled (tau < 0) and beta = 0 with data-size initial weights is sample-weighted FedAvg on the
    # model; the prototypes are the client part's own server side either way
    a = digits_simulation("fedproto", rounds=2)
    b = digits_simulation("fedproto+heal", {"tau": -1.0, "beta": 0.0, "fael_init": "datasize"}, rounds=2)
    ra, rb = a.run(), b.run()
    assert same_params(a.global_params, b.global_params, tol=1e-6)
    assert torch.allclose(a.server_half_state.protos, b.server_half_state.protos, atol=1e-5)
    assert rb[-1]["proto_acc"] == ra[-1]["proto_acc"] and ra[-1]["global_acc"] == rb[-1]["global_acc"]


LEARNS = [
    ("fedproto", {}),
    ("fedproc", {}),  # the curriculum over the run's 4 rounds
    ("fedavg+afl", {}),
    ("fedprox+qffl", {}),  # q = 1 with L = 1/lr (-m lipschitz=lr) stays at 10% accuracy here; the auto L learns
    ("fedavg+fedfv", {}),
    ("moon+afl", {"projection": 0}),
    ("scaffold+afl", {}),
]


@pytest.mark.parametrize("method, args", LEARNS, ids=[m for m, _ in LEARNS])
def test_short_runs_learn(method, args, one_thread):
    recs = digits_simulation(method, args, rounds=4).run()
    accs = [r["global_acc"] for r in recs]
    assert accs[-1] > 0.3 and accs[-1] > accs[0], accs
    if method in ("fedproto", "fedproc"):
        assert 0.3 < recs[-1]["proto_acc"] <= 1.0


def test_prototype_views_per_domain(tmp_path, fake_domains, one_thread):
    cfg = fake_domains_config(tmp_path, method="fedproc+heal")
    r = Simulation(cfg, fed.build_federated(cfg)).run()[-1]
    accs = [r[f"proto_domain_acc/{d}"] for d in "abc"]
    assert r["proto_domain_acc_avg"] == pytest.approx(np.mean(accs))
    assert r["proto_domain_acc_std"] == pytest.approx(np.std(accs, ddof=1))
    assert r["proto_acc"] == pytest.approx(np.dot(accs, [50, 30, 40]) / 120)


STATEFUL = [
    ("fedavg+afl", {}),
    ("scaffold+afl", {"restart": True}),
    ("fedavg+fedfv", {"tau": 2}),
    ("fedproc+qffl", {"curriculum_rounds": 4}),
]


@pytest.mark.parametrize("method, args", STATEFUL, ids=[m for m, _ in STATEFUL])
def test_resume_continues_exactly(tmp_path, method, args, one_thread):
    over = {"clients": 6, "join_ratio": 0.5}
    whole = digits_simulation(method, args, rounds=4, **over)
    expected = without_timing(whole.run())
    first = digits_simulation(method, args, rounds=4, **over)
    head = [first.round(r).record for r in (1, 2)]
    torch.save(capture(first), tmp_path / "ck.pt")
    resumed = digits_simulation(method, args, rounds=4, **over)
    restore(resumed, torch.load(tmp_path / "ck.pt", weights_only=False))
    tail = [resumed.round(r).record for r in (3, 4)]
    assert without_timing(head + tail) == expected
    if method.startswith("fedproc"):  # the prototype view shows through the loss-before wrapper
        assert all("proto_acc" in r for r in expected)
    assert same_params(resumed.global_params, whole.global_params)


def test_wrappers_forward_every_hook_by_construction_and_skip_unused_ones():
    """A wrapper forwards each LocalAlgorithm hook (whatever hooks it gains later) to the part it wraps, and the
    training loop sees through the forwarders: a hook the wrapped part does not use is never called."""
    from fedskew.client.local import HOOKS, LocalAlgorithm, Wrapper, overrides

    calls = []

    class Recorder(LocalAlgorithm):
        pass

    for hook in HOOKS:
        setattr(Recorder, hook, lambda self, *a, _h=hook, **k: calls.append(_h) or _h)

    wrapped = Wrapper()
    wrapped.inner = Recorder()
    for hook in HOOKS:
        assert getattr(wrapped, hook)(None) == hook and overrides(wrapped, hook)
    assert calls == list(HOOKS)
    plain = LossBefore(LocalAlgorithm())  # +afl, +qffl, +fedfv on FedAvg: no per-step hook calls at all
    assert [h for h in ("loss", "after_backward", "after_step", "end") if overrides(plain, h)] == []
    assert overrides(plain, "begin")  # its own work
    assert overrides(LossAfter(LossBefore(FedProto())), "loss")  # through two wrappers to FedProto's loss
