"""Live loggers (fedskew.results.loggers): what TensorBoard, MLflow and W&B receive is read back with each tracker's
own reader and compared with metrics.jsonl; a sweep's runs share a group; a failing logger never loses the run."""

from __future__ import annotations

import json
import sqlite3
import struct
import warnings
from pathlib import Path

import pytest

from fedskew.config import NOT_IDENTITY, ConfigError, make_config
from fedskew.results import loggers as L
from fedskew.runner import StopRun, resume_config, run_experiment

TINY = {"dataset": "digits", "clients": 4, "rounds": 3, "method": "fedavg+disco", "checkpoint_every": 0}


@pytest.fixture(autouse=True)
def _private_home(tmp_path, monkeypatch):
    """Trackers write config and cache files: keep every one of them inside tmp_path, and offline."""
    home = tmp_path / "home"
    home.mkdir()
    dirs = {"HOME": "", "WANDB_DIR": "wandb", "WANDB_CACHE_DIR": "wandb-cache", "WANDB_CONFIG_DIR": "wandb-cfg"}
    dirs.update({"WANDB_DATA_DIR": "wandb-data", "XDG_CACHE_HOME": "cache", "XDG_CONFIG_HOME": "config"})
    for key, sub in dirs.items():
        monkeypatch.setenv(key, str(home / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_ENTITY", raising=False)


def _run(tmp_path: Path, log: list[str], name: str = "run", **kw):
    cfg = make_config(
        {**TINY, "out": str(tmp_path / "runs" / name), "db": str(tmp_path / "runs" / "f.db"), "log": log, **kw}
    )
    out = run_experiment(cfg)
    metrics = [json.loads(line) for line in (out.run_dir / "metrics.jsonl").read_text().splitlines()]
    return out, metrics


def _series(metrics: list[dict], key: str) -> list[tuple[int, float]]:
    return [(m["round"], m[key]) for m in metrics if key in m]


def _same(got: list[tuple[int, float]], metrics: list[dict], key: str, rel: float = 1e-6) -> None:
    want = _series(metrics, key)
    assert [s for s, _ in got] == [s for s, _ in want] and len(want) == 3, key
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=rel), key


def test_tensorboard_events_match_metrics(tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra (pip install 'fedskew[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, metrics = _run(tmp_path, ["tensorboard"])
    ea = EventAccumulator(str(out.run_dir / "tb"), size_guidance={"scalars": 0, "histograms": 0, "images": 0})
    ea.Reload()
    tags = ea.Tags()
    for key in ("global_acc", "global_local_acc", "train_loss", "bytes_up", "time_train"):
        got = [(e.step, e.value) for e in ea.Scalars(key)]
        _same(got, metrics, key)
    assert {"clients/global_local_acc", "diagnostics/weights"} <= set(tags["histograms"])
    weights = ea.Histograms("diagnostics/weights")
    assert [h.step for h in weights] == [1, 2, 3] and weights[0].histogram_value.num == 4
    assert any(t.startswith("skew/") and t.endswith("/high_frac") for t in tags["scalars"])
    assert "partition" in tags["images"]


def test_mlflow_file_store_matches_metrics(tmp_path):
    pytest.importorskip("mlflow", reason="the mlflow extra (pip install 'fedskew[mlflow]')")
    from mlflow.tracking import MlflowClient

    out, metrics = _run(tmp_path, ["mlflow"], log_group="grp")
    store = tmp_path / "runs" / "mlruns"
    assert store.is_dir()
    client = MlflowClient(tracking_uri=store.as_uri())
    exp = client.get_experiment_by_name("grp")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["fedskew.run_id"] == out.run_id
    assert run.data.params["method"] == "fedavg+disco" and run.data.params["clients"] == "4"
    for key in ("global_acc", "global_local_loss", "bytes_down"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        _same(got, metrics, key)
    assert run.data.metrics["summary/global_acc/final"] == pytest.approx(out.summary["global_acc"]["final"])
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "partition.png"} <= arts


def _wandb_records(path: Path):
    """The protobuf records of an offline run's transaction log (.wandb: W&B's LevelDB-style log, 32 KiB blocks of
    checksum/length/type-framed chunks), parsed with wandb's own Record message."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, buf = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec


def test_wandb_offline_run_matches_metrics(tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra (pip install 'fedskew[wandb]')")
    out, metrics = _run(tmp_path, ["wandb"], log_group="grp")
    (log,) = (out.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, run = {}, None
    for rec in _wandb_records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run = rec.run
        elif kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            history[int(items["_step"])] = items
    assert run is not None and run.run_group == "grp" and run.display_name == "run"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["method"] == "fedavg+disco" and config["clients"] == 4
    for key in ("global_acc", "train_loss", "global_local_acc"):
        got = [(s, h[key]) for s, h in sorted(history.items()) if key in h]
        _same(got, metrics, key)
    assert history[1]["clients/global_local_acc/_type"] == "histogram"
    assert history[2]["diagnostics/weights/_type"] == "histogram"


def test_a_sweeps_runs_share_one_mlflow_experiment(tmp_path):
    pytest.importorskip("mlflow", reason="the mlflow extra (pip install 'fedskew[mlflow]')")
    from mlflow.tracking import MlflowClient

    from fedskew.sweep.core import SweepSpec, expand, run_sweep, with_log

    spec = SweepSpec(
        name="tiny", base={k: v for k, v in TINY.items() if k != "method"}, seeds=2, out=str(tmp_path / "sw")
    )
    runs = with_log(expand(spec), "mlflow")
    assert {r.cfg.log_group for r in runs} == {"tiny"} and all(r.cfg.log == ["mlflow"] for r in runs)
    outcome = run_sweep(runs)
    assert [r.status for r in outcome.results] == ["finished", "finished"]
    client = MlflowClient(tracking_uri=(tmp_path / "sw" / "mlruns").as_uri())
    found = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert sorted(r.data.tags["fedskew.run_id"] for r in found) == sorted(outcome.run_ids())


class _Recorder:
    calls: list[str] = []

    def start(self, cfg, run_dir, group, ctx):
        self.calls.append(f"start {ctx.first_round} {group}")

    def round(self, result):
        self.calls.append(f"round {result.record['round']}")

    def end(self, summary):
        self.calls.append("end")

    def close(self):
        self.calls.append("close")


class _Boom(_Recorder):
    def round(self, result):
        super().round(result)
        if result.record["round"] == 2:
            raise RuntimeError("tracker down")


def test_a_failing_logger_warns_once_and_the_run_is_complete(tmp_path, monkeypatch):
    monkeypatch.setitem(L.LOGGERS, "boom", L.LoggerSpec(_Boom, (), "boom"))
    monkeypatch.setattr(_Recorder, "calls", [])
    notes: list[str] = []
    cfg = make_config({**TINY, "out": str(tmp_path / "r"), "db": str(tmp_path / "f.db"), "log": "boom"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run_experiment(cfg, on_note=notes.append)
    mine = [w for w in caught if "logger boom failed" in str(w.message)]
    assert len(mine) == 1 and "tracker down" in str(mine[0].message)
    assert [n for n in notes if "logger boom" in n] == [str(mine[0].message)]
    assert _Recorder.calls == ["start 1 ", "round 1", "round 2", "close"]  # switched off after the failure
    assert len((out.run_dir / "metrics.jsonl").read_text().splitlines()) == 3
    assert json.loads((out.run_dir / "status.json").read_text())["status"] == "finished"
    assert (out.run_dir / "summary.json").is_file()
    with sqlite3.connect(tmp_path / "f.db") as db:
        assert db.execute("select count(*) from runs where run_id = ?", (out.run_id,)).fetchone() == (1,)


def test_a_missing_package_is_refused_before_any_compute(tmp_path, monkeypatch):
    monkeypatch.setitem(L.LOGGERS, "ghost", L.LoggerSpec(_Recorder, ("fedskew_no_such_tracker",), "ghost"))
    cfg = make_config({**TINY, "out": str(tmp_path / "r"), "db": None, "log": ["ghost"]})
    with pytest.raises(ConfigError, match=r"fedskew\[ghost\]"):
        run_experiment(cfg)
    assert not (tmp_path / "r").exists()


def test_log_is_validated_and_not_part_of_the_experiment():
    assert {"log", "log_group", "log_uri"} <= NOT_IDENTITY
    a, b = make_config(TINY), make_config({**TINY, "log": "tensorboard, mlflow,tensorboard", "log_group": "g"})
    assert b.log == ["tensorboard", "mlflow"] and a.identity() == b.identity() and a.group_key() == b.group_key()
    with pytest.raises(ConfigError, match="unknown logger"):
        make_config({**TINY, "log": ["tensorbored"]})


def test_resume_accepts_log(tmp_path, monkeypatch):
    from fedskew.cli import build_parser
    from fedskew.commands.flags import config_from_args

    monkeypatch.setitem(L.LOGGERS, "rec", L.LoggerSpec(_Recorder, (), "rec"))
    monkeypatch.setattr(_Recorder, "calls", [])
    run_dir = tmp_path / "r"
    cfg = make_config({**TINY, "out": str(run_dir), "db": None, "checkpoint_every": 1})

    def stop(result):
        if result.record["round"] == 2:
            raise StopRun("enough")

    with pytest.raises(StopRun):
        run_experiment(cfg, on_round=stop)
    args = build_parser().parse_args(["run", "--resume", str(run_dir), "--log", "rec", "--log-uri", "file:/x"])
    resumed = config_from_args(args)
    assert resumed.log == ["rec"] and resumed.log_uri == "file:/x"
    assert resume_config(run_dir, {"log": ["rec"]}).log == ["rec"]
    out = run_experiment(resumed, resume=True)
    assert out.summary["rounds"] == 3
    assert _Recorder.calls == ["start 3 ", "round 3", "end", "close"]


def test_reproduce_passes_its_loggers_to_every_run_and_names_the_group():
    from fedskew.reproduce import load_paper, make_plan, planned_runs

    plan = make_plan(load_paper("feddisco"), "smoke", rows=["fedavg"])
    plan.log = "tensorboard"
    runs = planned_runs(plan)
    assert runs and all(r.cfg.log == ["tensorboard"] for r in runs)
    assert {r.cfg.log_group for r in runs} == {"reproduce-feddisco-smoke"}
    plan.log = None  # loggers change nothing a run computes: the same folders either way
    assert [r.name for r in planned_runs(plan)] == [r.name for r in runs]


def test_logger_names_as_text():
    from fedskew.results.loggers import parse_names

    assert parse_names("tensorboard, mlflow,tensorboard") == ["tensorboard", "mlflow"]
    assert parse_names("[]") == [] and parse_names('["wandb"]') == ["wandb"]  # Flower's run config carries text
    with pytest.raises(ValueError, match="unknown logger"):
        parse_names("[nosuch]")
