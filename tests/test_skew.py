"""Parameter-skew probes and the `fedskew skew` command."""

import json

import numpy as np
import pytest
import torch

from fedskew.cli import main
from fedskew.engine.probe import skew_probe
from fedskew.protocol import Upload
from fedskew.server.uploads import stack_uploads


def test_probe_records_client_values_means_and_aggregate():
    torch.manual_seed(0)
    g = {"w": torch.zeros(50), "b": torch.zeros(3)}
    ups = [Upload(c, {"w": torch.randn(50), "b": torch.randn(3)}, n) for c, n in enumerate([10, 30, 60])]
    rin = stack_uploads(ups, rnd=4, global_params=g, trainable=frozenset(g), label_hists=np.ones((3, 2)))
    agg = {"w": torch.arange(50.0), "b": torch.arange(3.0)}
    p = skew_probe(rin, agg, per_layer=3, seed=1)
    assert p["round"] == 4 and p["cids"] == [0, 1, 2]
    w = p["layers"]["w"]
    pos = w["positions"]
    assert 3 <= len(pos) <= 6 and w["M"] == 50
    x = rin.params["w"]
    for j, i in enumerate(pos):
        assert w["clients"][j] == pytest.approx(x[:, i].tolist())
        assert w["mean"][j] == pytest.approx(float(x[:, i].double().mean()))
        assert w["weighted_mean"][j] == pytest.approx(float((x[:, i].double() * torch.tensor([0.1, 0.3, 0.6])).sum()))
        assert w["aggregate"][j] == pytest.approx(float(i))
    # the top-cv positions are included
    cv = x.double().std(0, unbiased=False) / x.double().mean(0).abs()
    assert set(torch.topk(cv, 3).indices.tolist()) <= set(pos)
    assert 0 <= w["high_frac"] <= 1


def test_skew_command_writes_figure(tmp_path, capsys):
    run = tmp_path / "run"
    assert (
        main(["run", "--method", "fedsa", "--clients", "4", "--rounds", "3", "--quiet", "--no-db", "--out", str(run)])
        == 0
    )
    probes = [json.loads(x) for x in (run / "skew.jsonl").read_text().splitlines()]
    assert [p["round"] for p in probes] == [1, 2, 3]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert "fedsa_high_frac" in recs[-1]["diagnostics"]
    capsys.readouterr()
    assert main(["skew", str(run), "--round", "2"]) == 0
    out = capsys.readouterr().out
    assert "H/M" in out and (run / "skew.png").stat().st_size > 10_000
    assert main(["skew", str(run), "--round", "9"]) == 2
    assert main(["skew", str(tmp_path)]) == 2
