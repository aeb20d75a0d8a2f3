"""Issue 43: secure aggregation on fedskew's Flower apps (Flower's SecAgg+ workflow and mod, on the in-process Grid).

The server learns a round's uploads only as their sum: the sum it reads back equals the weighted sum of what the
clients trained (within SecAgg+'s quantization), a client lost mid-protocol is unmasked from its neighbours' shares,
what leaves a client is masked, a run equals the plain Flower run within the quantization and repeats bit for bit,
and the compositions whose server needs more than a sum are refused with the reason. The loopback deployment with
TLS is in tests/test_flower_deploy.py.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from conftest import run_records

from fedskew.cli import main
from fedskew.config import ConfigError, make_config

needs_flwr = pytest.mark.skipif(
    importlib.util.find_spec("flwr") is None, reason='flwr is not installed (pip install -e ".[flower]")'
)
pytestmark = needs_flwr

CLIP = 8.0
SEED = {"seed": 3}


def _uploads(num: int, seed: int = 0) -> dict[int, dict]:
    g = torch.Generator().manual_seed(seed)
    return {
        c: {
            "params": {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g), "n": torch.tensor(c + 2)},
            "extras": {"c": torch.randn(5, generator=g) * 0.5},
            "n": 10 * (c + 1),
            "loss": 0.5 + c,
        }
        for c in range(num)
    }


def _fake_app(uploads: dict[int, dict], lost: frozenset[int] = frozenset()):
    """A ClientApp with fedskew's SecAgg+ mod whose `train` replies with a fixed upload in fedskew's layout (a client
    in ``lost`` fails at training, after the key exchange: the protocol must unmask the others without it)."""
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.clientapp import ClientApp

    from fedskew.flower.codec import metrics_record, to_record
    from fedskew.flower.secagg import secagg_mod

    app = ClientApp(mods=[secagg_mod])

    @app.train()
    def train(msg, context):
        cid = int(msg.content["config"]["cid"])
        if cid in lost:
            raise RuntimeError(f"node of client {cid} lost")
        up = uploads[cid]
        content = RecordDict(
            {
                "params": to_record(up["params"]),
                "extras": to_record(up["extras"]),
                "metrics": metrics_record({"num-examples": up["n"], "train_loss": up["loss"]}),
                "meta": ConfigRecord({"cid": cid}),
            }
        )
        return Message(content, reply_to=msg)

    return app


def _secure(uploads: dict[int, dict], weights: dict[int, float], lost: frozenset[int] = frozenset(), clip=CLIP):
    from flwr.app import ConfigRecord, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID

    from fedskew.flower.inprocess import InProcessGrid, task_identity
    from fedskew.flower.secagg import secure_round

    grid = InProcessGrid(_fake_app(uploads, lost), [{"cid": c} for c in uploads], {})
    nodes = {c: grid.node_of("cid", c) for c in uploads}
    contents = {
        c: RecordDict(
            {"config": ConfigRecord({"cid": c, "round": 1, "secagg_weight": weights[c], "secagg_clip": clip} | SEED)}
        )
        for c in uploads
    }
    template = {k: torch.zeros_like(v) for k, v in uploads[0]["params"].items()}
    with task_identity(run_id=1, node_id=SUPERLINK_NODE_ID):
        out = secure_round(
            grid, nodes, contents, weights, template, shares=1.0, threshold=0.5, clip=clip, timeout=30.0, rnd=1
        )
    return out, grid


def test_the_server_reads_back_the_weighted_sum_and_the_summed_extras():
    uploads = _uploads(5)
    weights = {c: w for c, w in enumerate([0.1, 0.3, 0.2, 0.25, 0.15])}
    out, _ = _secure(uploads, weights)
    assert out.failed == {}
    s = out.sum
    assert s.cids == [0, 1, 2, 3, 4] and s.kind == "secagg+" and s.num_samples == [10, 20, 30, 40, 50]
    assert [m["train_loss"] for m in s.metrics] == [0.5, 1.5, 2.5, 3.5, 4.5]
    mean = s.mean()
    for name in ("w", "b"):
        exact = sum(weights[c] * uploads[c]["params"][name] for c in uploads) / sum(weights.values())
        # 2**22 levels over ±8 with stochastic rounding: each client's error below one level (3.8e-6)
        torch.testing.assert_close(mean[name], exact, atol=5 * 16 / 2**22, rtol=0)
        assert mean[name].dtype == torch.float32
    assert int(mean["n"]) == 6  # an integer buffer: the maximum, as the plain weighted mean takes it
    torch.testing.assert_close(
        s.summed_extras()["c"], sum(uploads[c]["extras"]["c"] for c in uploads), atol=5 * 16 / 2**22, rtol=0
    )
    torch.testing.assert_close(s.weights(), torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15], dtype=torch.float64))


def test_what_leaves_a_client_is_masked():
    uploads = _uploads(4)
    weights = dict.fromkeys(uploads, 0.25)
    _, grid = _secure(uploads, weights)
    from flwr.common import bytes_to_ndarray
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    masked = [m for m in grid.received if Key.MASKED_PARAMETERS in m.content.config_records[RECORD_KEY_CONFIGS]]
    assert len(masked) == 4
    for m in masked:
        assert all(len(rec) == 0 for rec in m.content.array_records.values())  # no clear array leaves the node
        vec = [bytes_to_ndarray(b) for b in m.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]]
        cid = int(m.content.config_records["fitres.metrics"]["cid"])
        plain = (0.25 * uploads[cid]["params"]["w"].numpy().astype(np.float64) + CLIP) * 2**22 / (2 * CLIP)
        # the quantized value sits in [0, 2**22); the masked one is uniform over [0, 2**32)
        assert np.abs(vec[1].astype(np.float64) - plain).mean() > 2**26


def test_a_client_lost_after_the_key_exchange_is_unmasked_from_its_neighbours_shares():
    uploads = _uploads(5, seed=1)
    weights = dict.fromkeys(uploads, 0.2)
    out, _ = _secure(uploads, weights, lost=frozenset({2}))
    assert set(out.failed) == {2} and "node of client 2 lost" in out.failed[2]
    s = out.sum
    assert s.cids == [0, 1, 3, 4]
    exact = sum(uploads[c]["params"]["w"] for c in (0, 1, 3, 4)) / 4  # renormalized over the survivors
    torch.testing.assert_close(s.mean()["w"], exact, atol=5 * 16 / 2**22, rtol=0)


def test_a_value_outside_the_range_fails_its_client_with_the_reason_never_clipped():
    uploads = _uploads(4)
    uploads[1]["params"]["w"][0, 0] = 100.0
    out, _ = _secure(uploads, dict.fromkeys(uploads, 0.25))
    assert set(out.failed) == {1}
    assert "'w' reaches 25" in out.failed[1] and "flower.secagg_clip" in out.failed[1]
    assert out.sum is not None and out.sum.cids == [0, 2, 3]


def test_fewer_than_two_clients_are_not_aggregated():
    uploads = _uploads(1)
    out, _ = _secure(uploads, {0: 1.0})
    assert out.sum is None and "at least 2 clients" in out.failed[0]


# FedDisco on sampled cohorts: the weights the server fixes before the round are Eq. 3 over the cohort, as the plain
# run computes them over the participants
@pytest.mark.parametrize(
    ("method", "extra"), [("fedavg", {}), ("scaffold", {}), ("fedprox+disco", {"join_ratio": 0.6})]
)
def test_a_secure_run_gives_the_plain_runs_numbers_within_the_quantization(tmp_path, method, extra):
    from fedskew.flower.inprocess import run_in_process
    from fedskew.flower.settings import FlowerSettings

    base = {"method": method, "clients": 5, "rounds": 3, "seed": 7, "threads": 1, **extra}
    plain = run_records(run_in_process(make_config(base, {"out": str(tmp_path / "plain"), "db": None})))
    secure = FlowerSettings(secagg=True)
    first = run_records(run_in_process(make_config(base, {"out": str(tmp_path / "s1"), "db": None}), secure))
    assert [r["aggregation"] for r in first] == ["secagg+"] * 3
    for p, s in zip(plain, first, strict=True):
        assert p["participants"] == s["participants"] == (3 if extra else 5)
        assert s["diagnostics"]["weights"] == pytest.approx(p["diagnostics"]["weights"], abs=1e-12)
        assert s["train_loss"] == pytest.approx(p["train_loss"], abs=1e-4)
        assert s["global_acc"] == pytest.approx(p["global_acc"], abs=0.01)
    if method == "fedavg":  # Flower's stochastic rounding seeded per (seed, client, round): it repeats exactly
        again = run_records(run_in_process(make_config(base, {"out": str(tmp_path / "s2"), "db": None}), secure))
        assert again == first


@pytest.mark.parametrize(
    ("method", "extra", "says"),
    [
        ("fedsa", {}, "FedSACombine"),
        ("fedavg+heal", {}, "masks each client's update"),
        ("fedcac", {}, "one model per client"),
        ("fedavg+afl", {}, "its weights (AflWeights) read the uploads"),
        ("fedavg", {"dp_clip": 0.5, "dp_noise": 1.0}, "user-level DP with SecAgg+ is not built"),
    ],
)
def test_a_composition_that_needs_more_than_a_sum_is_refused_with_the_reason(tmp_path, method, extra, says):
    from fedskew.flower.inprocess import run_in_process
    from fedskew.flower.settings import FlowerSettings

    cfg = make_config({"method": method, "clients": 3, "rounds": 1, **extra}, {"out": str(tmp_path / "r"), "db": None})
    with pytest.raises(ConfigError, match="cannot be securely aggregated") as err:
        run_in_process(cfg, FlowerSettings(secagg=True))
    assert says in str(err.value)
    assert not (tmp_path / "r").exists()  # refused before anything is written


def test_flower_new_refuses_before_writing_and_writes_the_setting(tmp_path, capsys):
    assert main(["flower", "new", str(tmp_path / "bad"), "--method", "fedsa", "--secagg"]) == 2
    assert "cannot be securely aggregated" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    assert main(["flower", "new", str(tmp_path / "bad2"), "--secagg-clip", "4"]) == 2
    assert "need --secagg" in capsys.readouterr().err
    assert main(["flower", "new", str(tmp_path / "app"), "--method", "fedavg", "--secagg", "--secagg-clip", "4"]) == 0
    text = (tmp_path / "app" / "pyproject.toml").read_text()
    assert "secagg = true" in text and "secagg_clip = 4.0" in text


def test_a_cohort_whose_quantized_sum_would_overflow_the_modulus_is_refused():
    from fedskew.flower.settings import SECAGG_MAX_COHORT, secagg_refusal
    from fedskew.methods import resolve_method

    fedavg = resolve_method("fedavg", {})
    assert SECAGG_MAX_COHORT == 1023
    assert secagg_refusal(make_config({"clients": 2000, "join_ratio": 0.5}), fedavg) is None
    why = secagg_refusal(make_config({"clients": 2000, "join_ratio": 0.6}), fedavg)
    assert why is not None and "expected cohort (1200 clients) exceeds the 1023" in why


def test_fedskew_methods_states_whether_a_composition_can_be_securely_aggregated(capsys):
    assert main(["methods", "fedprox+disco"]) == 0
    assert "secure aggregation on Flower (flower.secagg): yes" in capsys.readouterr().out
    assert main(["methods", "fedsa"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "secure aggregation on Flower (flower.secagg): no: its server combines the individual updates" in out


def test_the_secure_sums_are_on_the_models_device():
    # the decoded sum was rebuilt on the CPU beside a server whose model is on a GPU (the meta device stands in)
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

    from fedskew.flower import secagg

    gp = {"w": torch.zeros(2, device="meta"), "n": torch.zeros((), dtype=torch.long, device="meta")}
    layout = {"entries": [f"{secagg.PARAM}:w", f"{secagg.EXTRA}:e"], "dtypes": ["float32", "float32"], "ints": {"n": 3}}
    metrics = {secagg.LAYOUT: json.dumps(layout), "num-examples": 5, "cid": 0}
    got = {0: FitRes(Status(Code.OK, ""), ndarrays_to_parameters([]), 5, metrics)}
    rs = secagg._as_sums(got, [np.ones(2), np.ones(3)], {0: 1.0}, gp)
    assert {t.device.type for t in (*rs.sums.values(), *rs.extra_sums.values(), rs.extra_template["e"])} == {"meta"}
