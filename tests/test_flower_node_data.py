"""Issue 24: a real federation. Each node holds only its own data (``flower.data = node``: its own ``data-dir``), the
server holds none, and only what the method declares leaves a client before round 1. In a simulated deployment
(``flower.data = partition``) a node builds and caches only its own part.

* node-local data: 3 nodes, each with its own ``.npz`` in its own folder written here, a server whose configuration
  names no data directory: ``fedavg+disco`` for 2 rounds equals the simulator run on the same per-client files
  (``--dataset npz --partition given``) within 1e-6;
* data minimization: every message a client sends is inspected: no label histogram for ``fedavg`` and
  ``fedavg+heal``, one scalar ``d_k`` per client for ``fedavg+disco`` (the simulator's, within 1e-6), the histogram
  only under ``report=histogram``; test histograms never;
* the hello refuses a node of another fedskew version or configuration, naming both;
* a node's cached part equals its part of the simulator's partition, and a fresh process loads it instead of the
  dataset.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("flwr")

from conftest import digits_nodes  # noqa: E402

from fedskew.cli import main  # noqa: E402
from fedskew.config import make_config  # noqa: E402
from fedskew.flower.settings import NODE_DATA, FlowerSettings, run_config  # noqa: E402

FAST = FlowerSettings(poll_interval=0.001)
NODE = FlowerSettings(poll_interval=0.001, data="node")


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _node_grid(cfg, settings, nodes):
    from fedskew.flower.client_app import app
    from fedskew.flower.inprocess import InProcessGrid

    configs = [{"cid": c, "data-dir": str(d)} for c, d in enumerate(nodes)]
    return InProcessGrid(app, configs, run_config(cfg, settings))


@pytest.mark.parametrize("server_test", [False, True], ids=["federated-evaluation", "server-test-file"])
def test_node_local_data_equals_the_simulator_on_the_same_client_files(tmp_path, one_thread, server_test):
    from fedskew.catalog.disco import DISCREPANCY, discrepancy
    from fedskew.flower.inprocess import record_differences, run_in_process

    given, nodes = digits_nodes(tmp_path)
    common = {"clients": 3, "rounds": 2, "seed": 5, "model": "mlp", "method": "fedavg+disco", "threads": 1}
    sim = tmp_path / "sim"
    argv = ["run", "--dataset", "npz", "--data-dir", str(given), "--partition", "given", "--no-db", "--quiet"]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in common.items()] + ["--out", str(sim)]
    assert main(argv) == 0
    server_values = {**common, "dataset": "npz", "data_dir": NODE_DATA, "out": str(tmp_path / "fl"), "db": None}
    cfg = make_config(server_values)
    settings = NODE.model_copy(update={"test_data": str(tmp_path / "server_test.npz") if server_test else None})
    grid = _node_grid(cfg, settings, nodes)
    run_in_process(cfg, settings, grid=grid)

    worst, diffs = record_differences(_lines(tmp_path / "fl" / "metrics.jsonl"), _lines(sim / "metrics.jsonl"))
    assert not diffs and worst <= 1e-6
    assert _lines(tmp_path / "fl" / "client_metrics.jsonl") == _lines(sim / "client_metrics.jsonl")
    # the server's configuration names no data at all: a server that read client data would have failed
    server_cfg = (tmp_path / "fl" / "config.yaml").read_text()
    assert f"data_dir: {NODE_DATA}" in server_cfg and not any(str(n) in server_cfg for n in nodes)
    summary = json.loads((tmp_path / "fl" / "summary.json").read_text())
    assert summary["evaluation"]["where"].startswith(
        "the global model on the server's test_data" if server_test else "federated"
    )
    assert summary["flower"]["data"] == "node"
    # each node was given only its own directory, and the server learned one d_k per client and the sample counts
    assert {m.metadata.dst_node_id: grid.contexts[m.metadata.dst_node_id].node_config["data-dir"] for m in grid.sent}
    known = json.loads((tmp_path / "fl" / "clients.json").read_text())
    train = [np.bincount(np.load(n / "data.npz")["y"], minlength=10) for n in nodes]
    assert known["num_train"] == [int(h.sum()) for h in train] and ("global_test" in known) == server_test
    assert np.allclose(np.ravel(known["reports"][DISCREPANCY]), discrepancy(np.stack(train), None), atol=1e-12)


def _messages_from_clients(grid, kind):
    return [m for m in grid.received if m.metadata.message_type == kind and not m.has_error()]


def _record_keys(message):
    return {(name, key) for name, rec in message.content.items() for key in rec}


@pytest.mark.parametrize("method", ["fedavg", "fedavg+heal", "fedavg+disco", "fedavg+disco(report=histogram)"])
def test_only_what_the_method_declares_leaves_a_client(tmp_path, one_thread, method):
    from fedskew.catalog.disco import DISCREPANCY, discrepancy
    from fedskew.flower.inprocess import make_grid, run_in_process
    from fedskew.flower.node_data import cached_part

    method_args = {"report": "histogram"} if "histogram" in method else {}
    name = method.split("(")[0]
    values = {"clients": 4, "rounds": 2, "seed": 3, "method": name, "method_args": method_args, "threads": 1}
    cfg = make_config({**values, "out": str(tmp_path / "fl"), "db": None, "skew_probes": 0})
    grid = make_grid(cfg, FAST)
    run_in_process(cfg, FAST, grid=grid)

    hellos = _messages_from_clients(grid, "query.hello")
    assert len(hellos) == 4
    hists = np.stack([cached_part(cfg, c).train_hist for c in range(4)])
    for msg in hellos:
        cid, hello = int(msg.content["meta"]["cid"]), msg.content["hello"]
        if name == "fedavg+disco" and not method_args:
            assert set(hello) == {"num_train", DISCREPANCY} and len(hello[DISCREPANCY]) == 1
            expected = discrepancy(hists[cid][None, :], None)[0]
            assert hello[DISCREPANCY][0] == pytest.approx(expected, abs=1e-6)
        elif method_args:
            assert set(hello) == {"num_train", "label_hist"} and list(hello["label_hist"]) == hists[cid].tolist()
        else:
            assert set(hello) == {"num_train"}
        assert hello["num_train"] == int(hists[cid].sum())
    # no train or evaluate reply carries anything about the labels (only the model, counts, losses and scores)
    for kind in ("train", "evaluate"):
        for msg in _messages_from_clients(grid, kind):
            metrics = {k for n, k in _record_keys(msg) if n in ("metrics", "scores")}
            assert not any("hist" in k or "label" in k for k in metrics), metrics
    assert not any("test_hist" in str(_record_keys(m)) for m in grid.received)


def test_a_node_of_another_fedskew_version_or_configuration_is_refused(tmp_path, monkeypatch, one_thread):
    import fedskew.flower.client_app as client_app
    from fedskew.flower.inprocess import make_grid, run_in_process
    from fedskew.flower.server_app import FederationError

    cfg = make_config({"clients": 2, "rounds": 1, "out": str(tmp_path / "fl"), "db": None})
    monkeypatch.setattr(client_app, "__version__", "0.0.0-other")
    with pytest.raises(FederationError, match=r"runs fedskew 0\.0\.0-other, the server fedskew \d"):
        run_in_process(cfg, FAST, grid=make_grid(cfg, FAST))
    monkeypatch.undo()
    monkeypatch.setattr(client_app, "config_hash", lambda cfg: "0123456789abcdef")
    with pytest.raises(FederationError, match="runs configuration 0123456789abcdef, the server"):
        run_in_process(cfg, FAST, grid=make_grid(cfg, FAST))
    assert not (tmp_path / "fl").exists()  # refused before anything was written


def test_a_nodes_cached_part_is_its_part_and_a_fresh_process_reads_only_it(tmp_path, monkeypatch):
    import fedskew.flower.node_data as node_data
    from fedskew.data.federated import build_federated

    cfg = make_config({"clients": 6, "seed": 9, "validation": 0.2})
    full = build_federated(cfg)
    part = node_data.cached_part(cfg, 4)
    files = list((tmp_path / ".fedskew-cache" / "parts").glob("*.pt"))
    assert len(files) == 1 and not list(files[0].parent.glob("*.tmp"))  # written whole, atomically
    for field in ("x_train", "y_train", "x_test", "y_test", "x_val", "y_val"):
        assert np.array_equal(getattr(part.client, field).numpy(), getattr(full.clients[4], field).numpy())
    assert (part.num_classes, part.in_channels, part.image_size) == (10, 1, 8)

    def no_dataset(*args, **kwargs):
        raise AssertionError("a cached part must not build the federation")

    monkeypatch.setattr(node_data, "build_federated", no_dataset)
    again = node_data.cached_part(cfg, 4)
    assert np.array_equal(again.client.x_train.numpy(), part.client.x_train.numpy())
    files[0].write_bytes(b"damaged")  # a damaged cache file is rebuilt, never trusted
    monkeypatch.undo()
    rebuilt = node_data.cached_part(cfg, 4)
    assert np.array_equal(rebuilt.client.y_train.numpy(), full.clients[4].y_train.numpy())
    other = node_data.part_key(cfg.model_copy(update={"seed": 10}), 4)
    assert other != node_data.part_key(cfg, 4) != node_data.part_key(cfg, 3)


def test_node_mode_errors_name_the_problem(tmp_path, one_thread):
    from fedskew.config import ConfigError
    from fedskew.flower.node_data import own_part
    from fedskew.flower.settings import parse_run_config

    cfg, settings = parse_run_config(
        run_config(make_config({"dataset": "npz", "data_dir": NODE_DATA, "clients": 2}), NODE)
    )
    assert settings.data == "node" and cfg.data_dir == NODE_DATA
    with pytest.raises(ConfigError, match="data-dir"):
        own_part(cfg, 0)
    per_client = tmp_path / "pc"
    (per_client / "train").mkdir(parents=True)
    for c in range(2):
        np.savez(per_client / "train" / f"{c}.npz", x=np.zeros((4, 1, 8, 8), np.uint8), y=np.arange(4))
    with pytest.raises(ConfigError, match="only its own data"):
        own_part(cfg.model_copy(update={"data_dir": str(per_client)}), 0)


def test_federated_evaluation_per_domain_from_the_nodes_domains(tmp_path, one_thread):
    """A real federation whose nodes name their domain (node config ``domain``): with no test set on the server, the
    per-domain accuracy (FedHEAL's AVG and STD) pools the clients' own scores of the global model by domain."""
    from fedskew.flower.client_app import app
    from fedskew.flower.inprocess import InProcessGrid, run_in_process

    _, nodes = digits_nodes(tmp_path)
    values = {"clients": 3, "rounds": 1, "seed": 2, "model": "mlp", "method": "fedavg+heal", "threads": 1}
    cfg = make_config({**values, "dataset": "npz", "data_dir": NODE_DATA, "out": str(tmp_path / "fl"), "db": None})
    domains = ["paper", "paper", "screen"]
    configs = [{"cid": c, "data-dir": str(d), "domain": domains[c]} for c, d in enumerate(nodes)]
    grid = InProcessGrid(app, configs, run_config(cfg, NODE))
    run_in_process(cfg, NODE, grid=grid)
    [record] = _lines(tmp_path / "fl" / "metrics.jsonl")
    scores = {}
    for msg in _messages_from_clients(grid, "evaluate"):
        got = msg.content["scores"]
        scores[int(msg.content["meta"]["cid"])] = (got["global_local/correct"], got["global_local/count"])
    paper = (scores[0][0] + scores[1][0]) / (scores[0][1] + scores[1][1])
    screen = scores[2][0] / scores[2][1]
    assert record["domain_acc/paper"] == pytest.approx(paper, abs=1e-12)
    assert record["domain_acc/screen"] == pytest.approx(screen, abs=1e-12)
    assert record["domain_acc_avg"] == pytest.approx((paper + screen) / 2, abs=1e-12)
    assert record["domain_acc_std"] == pytest.approx(np.std([paper, screen], ddof=1), abs=1e-12)
    configs[2].pop("domain")  # some nodes name a domain and one does not: refused, naming it
    grid = InProcessGrid(app, configs, run_config(cfg, NODE))
    with pytest.raises(Exception, match=r"clients \[2\] name no domain"):
        run_in_process(cfg.model_copy(update={"out": str(tmp_path / "fl2")}), NODE, grid=grid)
