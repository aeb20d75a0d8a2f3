"""Streaming aggregation (issue 46): a weighted mean summed upload by upload gives the stacked path's model (up to
float64 rounding) in memory that does not grow with the clients; compositions that read the individual uploads are
refused with the reason; auto streams only where nothing else reads the stack."""

import json

import pytest
import torch

from fedskew.config import make_config
from fedskew.engine.round_server import streams
from fedskew.methods import resolve_method
from fedskew.protocol import ServerContext, Upload
from fedskew.runner import run_experiment
from fedskew.schema import ConfigError
from fedskew.server.combine import WeightedMean
from fedskew.server.streaming import RunningSum, stream_refusal
from fedskew.server.uploads import UploadStack
from fedskew.server.weights import SampleWeights, UniformWeights

TEMPLATE = {"w": torch.zeros(40, 7), "b": torch.zeros(7), "n": torch.tensor(0, dtype=torch.int64)}


def _uploads(k, seed=0):
    g = torch.Generator().manual_seed(seed)
    for cid in range(k):
        params = {"w": torch.randn(40, 7, generator=g), "b": torch.randn(7, generator=g), "n": torch.tensor(3 * cid)}
        extras = {"dc": torch.randn(5, generator=g)}
        yield Upload(cid, params, int(torch.randint(5, 50, (1,), generator=g)), extras, {"train_loss": 0.1 * cid})


@pytest.mark.parametrize("weighting", [SampleWeights(), UniformWeights()])
def test_running_sums_give_the_stacked_weighted_mean(weighting):
    k = 25
    stack = UploadStack(k, TEMPLATE)
    running = RunningSum(TEMPLATE, weighting.arrival_weight)
    for up in _uploads(k):
        assert stack.add(up) is None and running.add(up) is None
    rin = stack.round_input(rnd=1, trainable=frozenset({"w", "b"}))
    weights, _ = weighting(rin, None, None)
    expected, _, _ = WeightedMean()(rin, weights, None, None)
    got = running.mean()
    torch.testing.assert_close(running.weights(), weights, rtol=1e-15, atol=0)
    for n, t in expected.items():
        assert got[n].dtype == t.dtype
        torch.testing.assert_close(got[n], t, rtol=1e-6, atol=1e-7)
    assert int(got["n"]) == 3 * (k - 1)  # integer buffers: the maximum, as WeightedMean takes
    torch.testing.assert_close(running.summed_extras()["dc"], rin.extras["dc"].sum(0), rtol=1e-5, atol=1e-6)
    assert running.cids == list(range(k)) and running.num_samples == stack.num_samples


def test_running_sums_hold_one_model_whatever_the_number_of_clients():
    def held(k):
        running = RunningSum(TEMPLATE, SampleWeights().arrival_weight)
        for up in _uploads(k):
            running.add(up)
        tensors = [*running.sums.values(), *(running.extra_sums or {}).values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    assert held(2) == held(200) == (40 * 7 + 7) * 8 + 8 + 5 * 8  # float64 sums of the model, one int, the extras


def test_an_invalid_upload_is_rejected_before_it_is_summed():
    running = RunningSum(TEMPLATE, SampleWeights().arrival_weight)
    good, bad = list(_uploads(2))
    bad.params["w"][0, 0] = float("nan")
    assert running.add(good) is None
    before = running.sums["w"].clone()
    assert running.add(bad) is not None and running.count == 1 and len(running.rejected) == 1
    assert torch.equal(running.sums["w"], before)


@pytest.mark.parametrize(
    ("method", "why"),
    [
        ("fedsa", "combines the individual updates (FedSACombine)"),
        ("fedavg+heal", "masks each client's update"),
        ("fedcac", "one model per client"),
        ("fedavg+disco", "depend on the whole round's uploads or reports"),
        ("feddyn", "reads the individual uploads"),
        ("fedavg+ccvr", "calibrated"),
        ("feddbe", "server half (DbeServer)"),
    ],
)
def test_compositions_that_read_the_individual_uploads_cannot_stream(method, why):
    assert why in stream_refusal(resolve_method(method, {}))


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "scaffold", "ditto", "fedavg+fedavgm", "fedper", "moon"])
def test_weighted_mean_compositions_can_stream(method):
    assert stream_refusal(resolve_method(method, {})) is None


def _lines(path):
    return [json.loads(s) for s in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("method", "args"),
    [("fedavg", {}), ("fedavg", {"weights": "uniform"}), ("scaffold", {}), ("fedavg+fedavgm", {}), ("ditto", {})],
)
def test_a_streaming_run_gives_the_stacked_runs_records(tmp_path, monkeypatch, method, args):
    summed = []
    add = RunningSum.add
    monkeypatch.setattr(RunningSum, "add", lambda self, up, *rest: summed.append(up.cid) or add(self, up, *rest))
    base = {"method": method, "method_args": args, "clients": 6, "rounds": 3, "skew_probes": 0, "db": None}
    for mode in ("stacked", "streaming"):
        run_experiment(make_config(None, {**base, "aggregation": mode, "out": str(tmp_path / mode)}))
        assert len(summed) == (0 if mode == "stacked" else 18)  # 6 clients × 3 rounds summed as they arrived
    stacked, streamed = _lines(tmp_path / "stacked"), _lines(tmp_path / "streaming")
    assert len(stacked) == len(streamed) == 3
    for a, b in zip(stacked, streamed, strict=True):
        assert a["participants"] == b["participants"]
        assert b["aggregation"] == "streaming" and "aggregation" not in a
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert b["global_acc"] == pytest.approx(a["global_acc"], abs=1e-2)
        assert b["diagnostics"]["weights"] == pytest.approx(a["diagnostics"]["weights"], rel=1e-12)


def test_streaming_is_refused_where_something_reads_the_stack_and_auto_streams_only_large_rounds(monkeypatch):
    with pytest.raises(ConfigError, match="aggregation streaming: method 'fedsa': its server combines"):
        make_config(None, {"method": "fedsa", "aggregation": "streaming", "skew_probes": 0})
    with pytest.raises(ConfigError, match="skew probes read every upload: set skew_probes 0"):
        make_config(None, {"aggregation": "streaming"})
    with pytest.raises(ConfigError, match="user-level DP"):
        make_config(None, {"aggregation": "streaming", "skew_probes": 0, "dp_clip": 1.0, "dp_noise": 1.0})

    import fedskew.engine.round_server as rs

    ctx = ServerContext(4, 10, {"w": torch.zeros(1000)}, frozenset({"w"}), torch.full((4,), 10).numpy())

    def decide(method="fedavg", **over):
        cfg = make_config(None, {"method": method, "clients": 4, **over})
        return streams(cfg.round_settings(), resolve_method(method, {}), ctx)

    assert not decide(skew_probes=0)  # 4 × 4 KB: far below the threshold
    monkeypatch.setattr(rs, "STREAM_ABOVE", 1000)
    assert decide(skew_probes=0)  # above it: the composition streams
    assert not decide()  # the skew probe reads the stack
    assert not decide("fedsa", skew_probes=0)  # the composition reads the uploads
    assert not decide(skew_probes=0, aggregation="stacked")
