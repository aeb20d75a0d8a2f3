"""Issue 24 (item 3): only what a method declares leaves a client. Each part declares the client reports it needs
(protocol.ClientReport); the engine computes those and nothing else, so the server pieces see the same in the simulator
as on Flower. FedDisco's d_k computed on the client gives the weights computed from the histogram on the server."""

from __future__ import annotations

import json

import numpy as np
import pytest

import fedskew
from fedskew.catalog.disco import DISCREPANCY, discrepancy
from fedskew.cli import main
from fedskew.methods import resolve_method
from fedskew.protocol import LABEL_HIST, ClientReport, client_reports, unique_reports
from fedskew.registry import unregister


@pytest.mark.parametrize(
    ("method", "args", "expected"),
    [
        ("fedavg", {}, set()),
        ("fedavg+heal", {}, set()),
        ("fedsa", {}, set()),
        ("fedcac", {}, set()),
        ("fedavg+disco", {}, {DISCREPANCY}),
        ("fedprox+disco", {"report": "histogram"}, {"label_hist"}),
        ("fedgen", {}, {"label_hist"}),
        ("fedgen+disco", {"report": "histogram"}, {"label_hist"}),  # declared twice, sent once
        ("fedgen+disco", {}, {"label_hist", DISCREPANCY}),
    ],
)
def test_methods_declare_what_they_need_from_clients(method, args, expected):
    reports = resolve_method(method, args).reports
    assert {r.name for r in reports} == expected and len(reports) == len(expected)


def test_client_reports_are_computed_client_by_client():
    hists = np.array([[3, 0, 1], [0, 5, 5]])
    got = client_reports([LABEL_HIST], hists)
    assert got["label_hist"].dtype == np.float64 and np.array_equal(got["label_hist"], hists)
    d = resolve_method("fedavg+disco", {"metric": "l2"}).reports
    assert np.allclose(client_reports(d, hists)[DISCREPANCY][:, 0], discrepancy(hists, None, "l2"), atol=0)
    other = ClientReport("label_hist", lambda h: h * 2, "not the histogram")
    with pytest.raises(ValueError, match="different client reports named 'label_hist'"):
        unique_reports([LABEL_HIST, other])


def _metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_disco_on_client_discrepancies_equals_disco_on_server_histograms(tmp_path):
    base = ["run", "--method", "fedavg+disco", "--rounds", "2", "--clients", "5", "--no-db", "--quiet"]
    assert main([*base, "--out", str(tmp_path / "d")]) == 0
    assert main([*base, "-m", "report=histogram", "--out", str(tmp_path / "h")]) == 0
    a, b = _metrics(tmp_path / "d"), _metrics(tmp_path / "h")
    assert [r["global_acc"] for r in a] == [r["global_acc"] for r in b]
    assert [r["diagnostics"]["weights"] for r in a] == [r["diagnostics"]["weights"] for r in b]


def test_a_user_weighting_sees_label_histograms_only_when_it_declares_them():
    from fedskew.config import make_config
    from fedskew.data.federated import build_federated

    seen = {}

    @fedskew.weighting("hist_blind_test")
    def blind(rin, params):
        seen["blind"] = rin.label_hists
        return rin.num_samples

    @fedskew.weighting("hist_share_test", reports=(LABEL_HIST,))
    def share(rin, params):
        seen["share"] = np.array(rin.label_hists)
        return rin.num_samples

    try:
        for name in ("hist_blind_test", "hist_share_test"):
            fedskew.run(f"fedavg+{name}", "digits", rounds=1, clients=4, join_ratio=1.0)
        assert seen["blind"] is None
        hists = build_federated(make_config({"clients": 4})).train_hists
        assert np.array_equal(seen["share"], hists)
    finally:
        unregister("hist_blind_test")
        unregister("hist_share_test")
