"""Issue 12: fedskew on Flower. The Flower path (the real ServerApp and ClientApp, real flwr Message/RecordDict objects
serialized and read back, on an in-process Grid: no Ray, no network) gives ``fedskew run``'s numbers; clients get their
own payloads and keep their state in ``context.state``; a client that stops replying fails its round, not the run.

The loopback deployment (separate SuperLink and SuperNode processes) is tests/test_flower_deploy.py.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sqlite3
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedskew.cli import main
from fedskew.config import ConfigError, make_config
from fedskew.protocol import TIMING_KEYS

HAS_FLWR = importlib.util.find_spec("flwr") is not None
needs_flwr = pytest.mark.skipif(not HAS_FLWR, reason='flwr is not installed (pip install -e ".[flower]")')
SRC = Path(__file__).resolve().parents[1] / "src" / "fedskew"

# the one thing that legitimately differs between the two engines' metrics.jsonl: wall-clock times
DIFFERENT = set(TIMING_KEYS)


def _config(tmp_path: Path, method: str, **over) -> dict:
    return {"method": method, "clients": 5, "rounds": 3, "seed": 7, "threads": 1, **over}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_same(a, b, where=""):
    """Equal, numbers within 1e-6 (bit-equal is what we get, 1e-6 is the contract)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(set(a) ^ set(b))}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, abs=1e-6, nan_ok=True), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in DIFFERENT} for r in records]


# ---- the equivalence harness -----------------------------------------------------------------------------------------
# cases that are a method with settings of its own: FedFomo's validation split; user-level DP (the node clips with
# the clip the server broadcasts and reports whether it clipped, the server noises and adapts the clip; Poisson
# cohorts, one of them possibly empty)
CASES = {
    "fedfomo": ("fedfomo", {"validation": 0.2}),
    "fedprox+dp": (
        "fedprox",
        {"dp_clip": 0.5, "dp_noise": 0.8, "client_sampling": "poisson", "join_ratio": 0.6}
        | {"dp_clip_quantile": 0.5, "dp_count_noise": 1.0},
    ),
    "scaffold+dp": ("scaffold", {"dp_clip": 0.5, "dp_noise": 0.8}),
    # streaming aggregation: the ServerApp sums each node's upload as it arrives (SCAFFOLD: its control deltas too)
    "scaffold+streaming": ("scaffold", {"aggregation": "streaming", "skew_probes": 0}),
    # FedDisco's weights from the d_k each node reported, released with the server's Gaussian noise
    "fedprox+disco+dp": (
        "fedprox+disco",
        {"dp_clip": 0.5, "dp_noise": 0.8, "dp_report_noise": 0.5, "client_sampling": "poisson", "join_ratio": 0.6},
    ),
}


@needs_flwr
@pytest.mark.parametrize(
    "method",
    # the four papers' methods, then issue 41's: a server step, a client part with a server half, an added term;
    # issue 42's personalizations: a server half and a folded bias, an adaptation step drawn on the client, heads
    # only, a weighting by a client metric, a composite head with personal entries, per-client downloads of peers
    [
        "fedavg",
        "fedsa",
        "fedprox+disco",
        "scaffold+heal",
        "fedcac",
        "fedprox+fedadam",
        "mofedsam",
        "fedlc+feddecorr",
        "feddbe",
        "perfedavg",
        "fedpac",
        "fedas",
        "fedcp",
        "fedfomo",
        "fedprox+dp",
        "scaffold+dp",
        "fedprox+disco+dp",
        "scaffold+streaming",
    ],
)
def test_flower_path_gives_fedskew_runs_metrics(tmp_path, one_thread, method):
    from fedskew.flower.inprocess import make_grid, run_in_process

    method, over = CASES.get(method, (method, {}))
    values = _config(tmp_path, method, **over)
    (tmp_path / "my.yaml").write_text(yaml.safe_dump(values))
    sim_dir, fl_dir = tmp_path / "sim", tmp_path / "flower"
    assert main(["run", "--config", str(tmp_path / "my.yaml"), "--out", str(sim_dir), "--db", "sim.db", "--quiet"]) == 0
    cfg = make_config(values, {"out": str(fl_dir), "db": str(tmp_path / "flower.db")})
    grid = make_grid(cfg)
    run_in_process(cfg, grid=grid)

    flower, simulator = _lines(fl_dir / "metrics.jsonl"), _lines(sim_dir / "metrics.jsonl")
    assert len(flower) == 3 and all(set(r) >= DIFFERENT for r in flower)
    _assert_same(_without_timing(flower), _without_timing(simulator), "metrics.jsonl")
    _assert_same(_lines(fl_dir / "client_metrics.jsonl"), _lines(sim_dir / "client_metrics.jsonl"), "client_metrics")
    if over.get("skew_probes", 1):
        _assert_same(_lines(fl_dir / "skew.jsonl"), _lines(sim_dir / "skew.jsonl"), "skew.jsonl")
    # config.yaml (but where the two runs write) and the label table (from what the clients reported) are the same
    fl_cfg, sim_cfg = (yaml.safe_load((d / "config.yaml").read_text()) for d in (fl_dir, sim_dir))
    assert (fl_cfg.pop("out"), fl_cfg.pop("db")) == (str(fl_dir), str(tmp_path / "flower.db"))
    assert (sim_cfg.pop("out"), sim_cfg.pop("db")) == (str(sim_dir), "sim.db")
    assert fl_cfg == sim_cfg and fl_cfg["model"] == "mlp"  # `auto` resolved the same way
    # the server learned only the clients' sample counts and what the method declared (issue 24): no histogram but
    # the FedDisco d_k row of the +disco composition, equal to the simulator's from the full histograms
    known, sim_known = (json.loads((d / "clients.json").read_text()) for d in (fl_dir, sim_dir))
    assert (
        known["num_train"] == [sum(h) for h in sim_known["train"]] and known["global_test"] == sim_known["global_test"]
    )
    assert "train" not in known and "test" not in known
    if "disco" in method:
        from fedskew.catalog.disco import DISCREPANCY, discrepancy

        assert set(known["reports"]) == {DISCREPANCY}
        expected = discrepancy(np.array(sim_known["train"]), None, "kl")
        assert np.allclose(np.ravel(known["reports"][DISCREPANCY]), expected, rtol=0, atol=1e-12)
    else:
        assert known["reports"] == {}
    summary, sim_summary = (json.loads((d / "summary.json").read_text()) for d in (fl_dir, sim_dir))
    assert summary["engine"] == "flower" and "engine" not in sim_summary
    assert set(summary) - set(sim_summary) == {"engine", "flower"} and summary["flower"]["failures"] == []
    assert summary["evaluation"] == {**sim_summary["evaluation"], "where": summary["evaluation"]["where"]}
    assert summary["headline"] == pytest.approx(sim_summary["headline"]) and summary["rounds"] == 3
    # the database rows: one run each, round rows equal but for the timings
    rows = {}
    for db in ("flower.db", "sim.db"):
        with sqlite3.connect(tmp_path / db) as conn:
            run = conn.execute("SELECT method, seed, rounds, summary FROM runs").fetchall()
            assert len(run) == 1 and run[0][:3] == (method, 7, 3)
            metrics = [json.loads(m) for (m,) in conn.execute("SELECT metrics FROM rounds ORDER BY round")]
            rows[db] = (json.loads(run[0][3]).get("engine"), _without_timing(metrics))
    assert rows["flower.db"][0] == "flower" and rows["sim.db"][0] is None
    _assert_same(rows["flower.db"][1], rows["sim.db"][1], "database rounds")
    # every client got its own message, keyed by cid; the node ids are Flower's (random), not the cids
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(trains) == sum(r["participants"] for r in simulator)  # 15 under full participation
    cids = {int(m.content["config"]["cid"]) for m in trains}
    assert cids == set(range(5)) if "join_ratio" not in over else cids <= set(range(5))
    assert all(m.metadata.dst_node_id == grid.node_of("cid", int(m.content["config"]["cid"])) for m in trains)


@needs_flwr
def test_clients_get_their_own_payloads_and_keep_state_in_context_state(tmp_path, one_thread):
    """FedCAC: one model per client from round 2; SCAFFOLD: the control variate travels as the broadcast and each
    client's c_i stays in its context.state; FedPer: the head never travels down."""
    from fedskew.flower.codec import STATE_PREFIX, from_record
    from fedskew.flower.inprocess import make_grid, run_in_process

    def run(method, **over):
        cfg = make_config(_config(tmp_path, method, rounds=2, **over), {"out": str(tmp_path / method), "db": None})
        grid = make_grid(cfg)
        run_in_process(cfg, grid=grid)
        return grid, [m for m in grid.sent if m.metadata.message_type == "train"]

    _, trains = run("fedcac")
    second = [from_record(m.content["model"]) for m in trains if m.metadata.group_id == "2"]
    assert len(second) == 5
    for i, a in enumerate(second):  # five different models: each client's own customized one
        for b in second[i + 1 :]:
            assert not all(torch.equal(a[k], b[k]) for k in a)

    grid, trains = run("scaffold+heal")
    assert all(any(k.startswith("scaffold_c/") for k in m.content["broadcast"]) for m in trains)
    c_round2 = from_record(trains[-1].content["broadcast"])
    assert any(t.abs().sum() > 0 for t in c_round2.values())  # the server's c moved after round 1
    for ctx in grid.contexts.values():
        assert f"{STATE_PREFIX}scaffold_ci" in ctx.state  # each client's own control variate, on its node

    grid, trains = run("fedper")
    evals = [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    assert len(trains) == len(evals) == 10
    assert all(not any(k.startswith("head.") for k in m.content["model"]) for m in trains)
    assert all(not any(k.startswith("head.") for k in m.content["global"]) for m in evals)


@needs_flwr
@pytest.mark.parametrize(
    "bounds, reason",
    [
        ({"round_timeout": 0.3}, "no reply within 0.3 s"),
        ({"round_timeout": 60, "straggler_timeout": 0.2}, "no reply within 0.2 s of the first one"),
    ],
)
def test_a_client_that_stops_replying_fails_its_round_and_the_run_goes_on(tmp_path, one_thread, bounds, reason):
    """Client 2 answers nothing in round 2 (a dead node): after the bounded wait (the phase's bound, or the straggler
    wait once the others replied) the round aggregates the other four, records client 2 as failed (training and
    evaluation), and the run finishes; in round 3 client 2 is back, with the state it kept."""
    from fedskew.flower.client_app import app as client_app
    from fedskew.flower.inprocess import InProcessGrid, run_in_process
    from fedskew.flower.settings import FlowerSettings, run_config

    class FlakyGrid(InProcessGrid):
        def push_messages(self, messages):
            messages = list(messages)
            dead = self.node_of("cid", 2)
            self.silent = {dead} if any(m.metadata.group_id == "2" for m in messages) else set()
            return super().push_messages(messages)

    settings = FlowerSettings(**bounds, poll_interval=0.05)
    cfg = make_config(_config(tmp_path, "scaffold"), {"out": str(tmp_path / "run"), "db": str(tmp_path / "f.db")})
    grid = FlakyGrid(client_app, [{"cid": c} for c in range(5)], run_config(cfg, settings))
    run_in_process(cfg, settings, grid=grid)
    recs = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [r["participants"] for r in recs] == [5, 4, 5]
    assert recs[1]["failed"] == [{"client": 2, "reason": reason}] and recs[1]["sampled"] == 5
    assert recs[1]["eval_failed"] == [{"client": 2, "reason": reason}]
    assert "failed" not in recs[0] and "failed" not in recs[2] and "eval_failed" not in recs[2]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [(f["round"], f["phase"], f["client"]) for f in summary["flower"]["failures"]] == [
        (2, "train", 2),
        (2, "evaluate", 2),
    ]
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "finished"


@needs_flwr
def test_a_restarted_supernode_rejoins_under_its_client_id(tmp_path, one_thread):
    """Client 2's SuperNode restarts after round 1: Flower gives it a new node id (and it lost its context.state);
    the server finds it by its cid before round 2 and the client takes part again, from a fresh state."""
    from flwr.app import Context, RecordDict

    from fedskew.flower.client_app import app as client_app
    from fedskew.flower.inprocess import InProcessGrid, run_in_process
    from fedskew.flower.settings import run_config

    class RestartingGrid(InProcessGrid):
        def push_messages(self, messages):
            messages = list(messages)
            ids = super().push_messages(messages)
            if any(m.metadata.message_type == "evaluate" and m.metadata.group_id == "1" for m in messages):
                old = self.node_of("cid", 2)
                self.old, self.new = old, old + 2
                ctx = self.contexts.pop(old)
                self.contexts[self.new] = Context(1, self.new, {"cid": 2}, RecordDict(), ctx.run_config)
            return ids

    cfg = make_config(_config(tmp_path, "scaffold", rounds=2), {"out": str(tmp_path / "run"), "db": None})
    grid = RestartingGrid(client_app, [{"cid": c} for c in range(5)], run_config(cfg))
    run_in_process(cfg, grid=grid)
    recs = _lines(tmp_path / "run" / "metrics.jsonl")
    assert [r["participants"] for r in recs] == [5, 5] and not any("failed" in r for r in recs)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["flower"]["rejoined"] == [{"round": 2, "client": 2}] and summary["flower"]["failures"] == []
    second = [m for m in grid.sent if m.metadata.group_id == "2" and int(m.content["config"]["cid"]) == 2]
    assert second and all(m.metadata.dst_node_id == grid.new for m in second)
    assert "fedskew.state/scaffold_ci" in grid.contexts[grid.new].state  # its state, started afresh on the new node


@needs_flwr
def test_a_client_app_that_raises_is_a_failed_client_with_its_error(tmp_path, one_thread):
    from fedskew.flower.client_app import app as client_app
    from fedskew.flower.inprocess import make_grid, run_in_process
    from fedskew.flower.settings import FlowerSettings

    def broken(msg, ctx):
        if ctx.node_config["cid"] == 1 and msg.metadata.message_type == "train":
            raise RuntimeError("disk full")
        return client_app(msg, ctx)

    cfg = make_config(_config(tmp_path, "fedavg", rounds=1), {"out": str(tmp_path / "run"), "db": None})
    grid = make_grid(cfg, FlowerSettings(round_timeout=5), client_app=broken)
    run_in_process(cfg, FlowerSettings(round_timeout=5), grid=grid)
    rec = _lines(tmp_path / "run" / "metrics.jsonl")[0]
    assert rec["participants"] == 4 and rec["failed"][0]["client"] == 1
    assert "RuntimeError: disk full" in rec["failed"][0]["reason"]


@needs_flwr
def test_missing_nodes_are_refused_before_anything_is_written(tmp_path):
    from fedskew.flower.inprocess import InProcessGrid, run_in_process
    from fedskew.flower.server_app import FederationError
    from fedskew.flower.settings import FlowerSettings, run_config

    settings = FlowerSettings(node_wait=0.2, poll_interval=0.05)
    cfg = make_config(_config(tmp_path, "fedavg"), {"out": str(tmp_path / "run"), "db": None})
    from fedskew.flower.client_app import app as client_app

    three = InProcessGrid(client_app, [{"cid": c} for c in range(3)], run_config(cfg, settings))
    with pytest.raises(FederationError, match="only 3 of 5 SuperNodes connected within 0.2 s"):
        run_in_process(cfg, settings, grid=three)
    twice = InProcessGrid(client_app, [{"cid": c % 4} for c in range(5)], run_config(cfg, settings))
    with pytest.raises(FederationError, match="both say they are client 0"):
        run_in_process(cfg, settings, grid=twice)
    assert not (tmp_path / "run").exists()


# ---- configuration the Flower way ------------------------------------------------------------------------------------
def test_app_config_holds_every_run_config_key_and_reads_back_to_the_same_config():
    from fedskew.flower.settings import FlowerSettings, app_config, parse_run_config, run_config

    cfg = make_config(
        {
            "method": "moon+heal",
            "method_args": {"heal.tau": 0.25, "moon.tau": 0.4, "projection": 0},
            "clients": 6,
            "db": None,
            "lr": 1e-3,
        },
    )
    flat = run_config(cfg, FlowerSettings(round_timeout=42))
    assert flat["method_args.heal.tau"] == 0.25 and flat["db"] == "" and flat["flower.round_timeout"] == 42.0
    assert {k for k in flat if "." not in k} == set(cfg.model_dump()) - {
        "method_args",
        "partition_args",
        "dataset_args",
    }
    back, settings = parse_run_config(flat)
    assert back == cfg and settings.round_timeout == 42
    # --run-config overrides are plain keys of the same table
    over, _ = parse_run_config({**flat, "rounds": 7, "method_args.heal.tau": 0.5})
    assert over.rounds == 7 and over.method_args["heal.tau"] == 0.5
    with pytest.raises(ConfigError, match="unknown table 'extra'"):
        parse_run_config({**flat, "extra.key": 1})
    with pytest.raises(ConfigError, match="lr"):
        parse_run_config({**flat, "lr": -1.0})
    with pytest.raises(ConfigError, match="round_timeout"):
        parse_run_config({**flat, "flower.round_timeout": 0})
    # a list-valued method argument travels as a YAML string (Flower's config holds scalars only)
    disco = make_config({"method": "fedavg+disco", "method_args": {"target": [0.1] * 10}, "db": None})
    text = app_config(disco)
    assert 'target = "[0.1, 0.1' in text
    assert parse_run_config(run_config(disco))[0].method_args["target"] == [0.1] * 10


def test_node_config_names_the_client(tmp_path):
    from fedskew.flower.settings import node_overrides

    assert node_overrides({"cid": 3, "data-dir": "/data/x"}) == (3, {"data_dir": "/data/x"})
    assert node_overrides({"partition-id": 1, "num-partitions": 4}) == (1, {})
    with pytest.raises(ConfigError, match='--node-config "cid=K"'):
        node_overrides({"other": 1})
    with pytest.raises(ConfigError, match="non-negative integer"):
        node_overrides({"cid": -1})


def test_flower_new_writes_a_ready_to_run_app_folder(tmp_path, capsys):
    (tmp_path / "my.yaml").write_text(yaml.safe_dump({"method": "fedprox+disco", "clients": 4, "rounds": 2}))
    assert main(["flower", "new", "--config", "my.yaml", "--lr", "0.02", "--round-timeout", "90", "app"]) == 0
    out = capsys.readouterr().out
    assert "flower-supernode" in out and "cid=K" in out and "K = 0..3" in out
    project = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())
    app = project["tool"]["flwr"]["app"]
    assert app["components"] == {
        "serverapp": "fedskew.flower.server_app:app",
        "clientapp": "fedskew.flower.client_app:app",
    }
    conf = app["config"]
    assert conf["method"] == "fedprox+disco" and conf["clients"] == 4 and conf["lr"] == 0.02
    assert conf["flower"]["round_timeout"] == 90.0 and project["project"]["dependencies"] == ["flwr>=1.41,<1.43"]
    # the folder's config is the run's config; a second `new` into it is refused
    from fedskew.flower.settings import parse_run_config, run_config

    cfg = make_config({"method": "fedprox+disco", "clients": 4, "rounds": 2, "lr": 0.02})
    assert parse_run_config(run_config(cfg))[0] == cfg
    assert main(["flower", "new", "--config", "my.yaml", "app"]) == 2
    assert "exists" in capsys.readouterr().err


# ---- the codec ---------------------------------------------------------------------------------------------------
@needs_flwr
def test_records_carry_tensors_bit_for_bit_and_client_state_round_trips():
    from flwr.app import RecordDict

    from fedskew.flower.codec import from_record, load_state, save_state, to_record

    params = {
        "conv.weight": torch.randn(4, 3).t(),  # not contiguous
        "bn.num_batches_tracked": torch.tensor(7),  # 0-dim int64
        "cac_mask/conv.weight": torch.rand(3, 4) > 0.5,
        "h": torch.randn(2, dtype=torch.float64),
    }
    back = from_record(to_record(params))
    assert list(back) == list(params)
    for k, t in params.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t)
    state = RecordDict()
    client_state = {"scaffold_ci": {"w": torch.ones(2)}, "count": 3, "history": [torch.zeros(1)]}
    save_state(state, client_state, trained={"w": torch.full((2,), 2.0)})
    got, trained = load_state(state)
    assert torch.equal(got["scaffold_ci"]["w"], torch.ones(2)) and got["count"] == 3
    assert torch.equal(got["history"][0], torch.zeros(1)) and torch.equal(trained["w"], torch.full((2,), 2.0))
    save_state(state, {"count": 4}, trained=None)  # what fedskew wrote before is replaced, not merged
    assert load_state(state) == ({"count": 4}, None)


# ---- the boundary and the extra --------------------------------------------------------------------------------
def test_only_the_flower_package_imports_flwr():
    importers = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if any(n == "flwr" or n.startswith("flwr.") for n in names):
                importers.append(path.relative_to(SRC).as_posix())
    assert importers and all(p.startswith("flower/") for p in importers), importers


def test_without_the_extra_the_commands_say_how_to_install_it(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flwr" else real(name, *a))
    assert main(["flower", "local", "--clients", "3", "--rounds", "1", "--no-db"]) == 2
    assert 'pip install -e ".[flower]"' in capsys.readouterr().err
    assert main(["methods"]) == 0
    assert 'on Flower (`fedskew flower` (install the extra: pip install -e ".[flower]")' in capsys.readouterr().out


@needs_flwr
def test_methods_lists_the_compositions_that_run_on_flower(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "on Flower (`fedskew flower`): every valid composition, with the simulator's metrics" in out


def test_flower_new_names_the_flag_of_a_bad_timeout(tmp_path, capsys):
    """Issue 46: --node-wait 0 and a negative --round-timeout were tracebacks; now one line naming the flag."""
    assert main(["flower", "new", "--node-wait", "0", str(tmp_path / "a")]) == 2
    assert "error: --node-wait: Input should be greater than 0" in capsys.readouterr().err
    assert main(["flower", "new", "--round-timeout", "-5", str(tmp_path / "b")]) == 2
    assert "--round-timeout: Input should be greater than 0" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
