"""Issue 11: never lose work, never touch what is not fedskew's: run directories, checkpoints and resume, signals,
the database."""

import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fedskew.cli import main
from fedskew.config import make_config
from fedskew.protocol import TIMING_KEYS
from fedskew.recorder import DatabaseWriteError, record_in_db
from fedskew.results import store
from fedskew.results.rundir import LOCK, RunDirectory, RunDirError
from fedskew.runner import run_experiment


def _cfg(tmp_path, name="run", **kw):
    values = {"clients": 5, "rounds": 4, "out": str(tmp_path / name), "db": None, "skew_probes": 0}
    values.update(kw)
    return make_config(None, values)


def _metrics(run_dir) -> list[dict]:
    out = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for k in TIMING_KEYS:
            rec.pop(k, None)
        out.append(rec)
    return out


# ---- safe outputs ---------------------------------------------------------------------------------------------------
def test_finished_run_keeps_files_created_in_its_directory_meanwhile(tmp_path):
    cfg = _cfg(tmp_path)

    def scribble(result):
        (tmp_path / "run" / f"note-{result.record['round']}.txt").write_text("mine")

    run_experiment(cfg, on_round=scribble)
    assert sorted(p.name for p in (tmp_path / "run").glob("note-*")) == [f"note-{r}.txt" for r in range(1, 5)]
    assert (tmp_path / "run" / "summary.json").is_file()
    assert not (tmp_path / "run" / LOCK).exists() and not (tmp_path / "run" / "checkpoint.pt").exists()


def test_concurrent_run_into_the_same_directory_is_refused(tmp_path):
    holder = RunDirectory.prepare(tmp_path / "run")  # this (live) process holds the lock
    try:
        with pytest.raises(RunDirError, match="being written by another fedskew run"):
            run_experiment(_cfg(tmp_path))
    finally:
        holder.unlock()


def test_overwrite_never_deletes_a_directory_that_is_not_a_run(tmp_path, capsys):
    runs = tmp_path / "runs"
    run_experiment(_cfg(runs, "earlier"))
    (runs / "fedskew.db").write_text("precious")
    rc = main(["run", "--rounds", "1", "--out", str(runs), "--overwrite", "--no-db", "--quiet"])
    assert rc == 2
    assert "not a fedskew run directory" in capsys.readouterr().err
    assert (runs / "fedskew.db").read_text() == "precious"
    assert (runs / "earlier" / "summary.json").is_file()


def test_overwrite_replaces_only_fedskews_own_files(tmp_path):
    run_experiment(_cfg(tmp_path, rounds=2))
    (tmp_path / "run" / "analysis.ipynb").write_text("user's")
    run_experiment(_cfg(tmp_path, rounds=1), overwrite=True)
    assert (tmp_path / "run" / "analysis.ipynb").read_text() == "user's"
    assert len(_metrics(tmp_path / "run")) == 1


def test_existing_finished_run_is_refused_without_overwrite(tmp_path):
    run_experiment(_cfg(tmp_path, rounds=1))
    with pytest.raises(RunDirError, match="--overwrite"):
        run_experiment(_cfg(tmp_path, rounds=1))


def test_out_naming_a_file_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["run", "--out", str(tmp_path / "f"), "--no-db", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "is a file" in err and "Traceback" not in err


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_out_is_a_one_line_error(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert main(["run", "--out", str(ro / "run"), "--no-db", "--quiet"]) == 2
        assert "cannot create run directory" in capsys.readouterr().err
    finally:
        ro.chmod(0o700)


def test_run_directory_respects_umask(tmp_path):
    run_experiment(_cfg(tmp_path, rounds=1))
    mode = (tmp_path / "run").stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o777 & ~umask


# ---- the database -------------------------------------------------------------------------------------------------
def test_unusable_database_path_is_refused_before_any_compute(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    rc = main(["run", "--db", str(tmp_path / "file" / "db.sqlite"), "--out", str(tmp_path / "run"), "--quiet"])
    assert rc == 2
    assert "results database" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_locked_database_is_retried_then_the_run_is_kept_for_db_import(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(store, "BUSY_TIMEOUT", 0.05)
    monkeypatch.setattr(store, "RETRY_DELAYS", (0.05, 0.05))
    db = tmp_path / "r.db"
    run_experiment(_cfg(tmp_path, "first", rounds=1, db=str(db)))  # creates the database
    blocker = sqlite3.connect(db)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        rc = main(["run", "--rounds", "2", "--clients", "4", "--out", str(tmp_path / "run"), "--db", str(db)])
    finally:
        blocker.rollback()
        blocker.close()
    assert rc == 4
    err = capsys.readouterr().err
    assert f"fedskew db import {tmp_path / 'run'}" in err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds"] == 2
    assert main(["db", "import", str(tmp_path / "run"), "--db", str(db)]) == 0
    assert main(["db", "import", str(tmp_path / "run"), "--db", str(db)]) == 0  # idempotent
    assert "already in" in capsys.readouterr().out
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 2
        assert conn.execute("SELECT count(*) FROM rounds").fetchone()[0] == 3
        n = conn.execute("SELECT count(*) FROM client_metrics WHERE view = 'global_local'").fetchone()[0]
    assert n == 1 * 5 + 2 * 4


@pytest.mark.parametrize(
    "damage, said",
    [
        (b'{"broken": ', "summary.json is damaged"),
        (b"\xff\xfe", "summary.json is damaged"),
        (b"[1, 2]", "is not a fedskew run summary"),
        ("config", "configuration cannot be read"),
    ],
)
def test_db_import_names_a_damaged_run_file_and_writes_nothing(tmp_path, capsys, damage, said):
    run = tmp_path / "run"
    assert main(["run", "--rounds", "1", "--clients", "4", "--out", str(run), "--no-db", "--quiet"]) == 0
    if damage == "config":
        (run / "config.yaml").write_text("seed: [\n")
    else:
        (run / "summary.json").write_bytes(damage)
    db = tmp_path / "r.db"
    assert main(["db", "import", str(run), "--db", str(db)]) == 2
    assert said in capsys.readouterr().err
    assert not db.exists()  # refused before the database was opened


def test_lock_released_during_the_retries_lets_the_insert_through(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "BUSY_TIMEOUT", 0.05)
    monkeypatch.setattr(store, "RETRY_DELAYS", (0.2, 0.4, 0.8, 1.6))
    db = tmp_path / "r.db"
    run_experiment(_cfg(tmp_path, "first", rounds=1, db=str(db)))
    blocker = sqlite3.connect(db, check_same_thread=False)
    blocker.execute("BEGIN EXCLUSIVE")
    threading.Timer(0.5, blocker.rollback).start()
    run_experiment(_cfg(tmp_path, rounds=1, db=str(db)))
    blocker.close()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 2


def test_import_refuses_an_unfinished_run(tmp_path):
    rd = RunDirectory.prepare(tmp_path / "run")
    rd.set_status("running", run_id="x")
    with pytest.raises(store.DatabaseError, match="no ended run"):
        record_in_db(tmp_path / "db.sqlite", tmp_path / "run")


def test_database_error_is_not_swallowed(tmp_path):
    with pytest.raises(DatabaseWriteError):
        raise DatabaseWriteError("x")


# ---- checkpoints and resume: kill at an arbitrary round, resume, identical metrics ----------------------------------
FAMILIES = [
    ("fedavg", {}),
    ("fedsa", {}),
    ("scaffold+heal", {}),
    ("fedprox+disco", {}),
    ("fedcac", {}),
    ("ditto", {}),
    ("fedamp", {}),
    ("moon", {"projection": 16}),
]


def _killed_child(cfg_values: dict, kill_after: int) -> None:
    """Run in a forked child: die like SIGKILL (no cleanup at all) right after round ``kill_after``."""
    cfg = make_config(None, cfg_values)

    def die(result):
        if result.record["round"] == kill_after:
            os._exit(137)

    run_experiment(cfg, on_round=die)
    os._exit(0)


def kill_after_round_3(tmp_path: Path, values: dict) -> dict:
    """Run ``values`` uninterrupted into ``tmp_path/whole``, and into ``tmp_path/killed`` in a forked child that dies
    like SIGKILL after round 3; the killed run's configuration values (run them again to resume it)."""
    run_experiment(make_config(None, {**values, "out": str(tmp_path / "whole")}))
    killed = {**values, "out": str(tmp_path / "killed")}
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(killed, 3))
    child.start()
    child.join(120)
    assert child.exitcode == 137
    return killed


@pytest.mark.parametrize("method, args", FAMILIES, ids=[m for m, _ in FAMILIES])
def test_killed_and_resumed_run_equals_an_uninterrupted_one(tmp_path, method, args):
    values = {
        "method": method,
        "method_args": args,
        "clients": 6,
        "join_ratio": 0.5,
        "rounds": 5,
        "checkpoint_every": 2,  # the kill after round 3 leaves a checkpoint of round 2 and metrics of round 3
        "skew_probes": 2,
        "db": None,
        "seed": 4,
    }
    killed = kill_after_round_3(tmp_path, values)
    status = json.loads((tmp_path / "killed" / "status.json").read_text())
    assert status["status"] == "running" and status["checkpoint_round"] == 2
    assert len(_metrics(tmp_path / "killed")) == 3
    assert (tmp_path / "killed" / LOCK).exists()  # the dead process's lock
    out = run_experiment(make_config(None, killed))  # the same command again resumes
    assert out.summary["rounds"] == 5
    assert _metrics(tmp_path / "killed") == _metrics(tmp_path / "whole")
    skew = [json.loads(line)["round"] for line in (tmp_path / "killed" / "skew.jsonl").read_text().splitlines()]
    assert skew == [1, 2, 3, 4, 5]
    assert json.loads((tmp_path / "killed" / "status.json").read_text())["status"] == "finished"


def test_resume_refuses_to_change_the_experiment(tmp_path, capsys):
    values = {"clients": 4, "rounds": 3, "checkpoint_every": 1, "db": None, "out": str(tmp_path / "run")}
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(values, 1))
    child.start()
    child.join(120)
    assert main(["run", "--resume", str(tmp_path / "run"), "--lr", "0.5", "--quiet"]) == 2
    assert "cannot change lr" in capsys.readouterr().err
    # a different configuration into the same --out is refused, naming --resume
    assert main(["run", "--out", str(tmp_path / "run"), "--lr", "0.5", "--no-db", "--quiet"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["run", "--resume", str(tmp_path / "run"), "--quiet"]) == 0


# ---- signals, through the real command line --------------------------------------------------------------------
def _cli(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    return subprocess.Popen(
        [sys.executable, "-m", "fedskew.cli", "run", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_rounds(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError("no progress")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_checkpoints_and_resume_matches_uninterrupted(tmp_path, sig, code):
    common = ["--rounds", "15", "--clients", "5", "--skew-probes", "0", "--no-db", "--quiet", "--seed", "2"]
    proc = _cli([*common, "--out", "sig"], tmp_path)
    _wait_for_rounds(tmp_path / "sig", 2, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "fedskew run --resume sig" in err
    status = json.loads((tmp_path / "sig" / "status.json").read_text())
    assert status["status"] == "interrupted" and status["checkpoint_round"] == status["completed_rounds"] < 15
    assert not (tmp_path / "sig" / LOCK).exists()
    assert main(["run", "--resume", str(tmp_path / "sig"), "--quiet"]) == 0
    assert main(["run", *common, "--out", str(tmp_path / "whole")]) == 0
    assert _metrics(tmp_path / "sig") == _metrics(tmp_path / "whole")


def test_sigkill_leaves_a_resumable_run_that_is_reported(tmp_path, capsys):
    common = ["--rounds", "15", "--clients", "5", "--skew-probes", "0", "--no-db", "--quiet"]
    proc = _cli([*common, "--out", "runs/k"], tmp_path)
    _wait_for_rounds(tmp_path / "runs" / "k", 2, proc)
    proc.kill()
    proc.wait()
    # another run under runs/ reports the killed one
    assert main(["run", "--rounds", "1", "--clients", "3", "--out", "runs/other", "--no-db", "--quiet"]) == 0
    assert "runs/k holds a run that was killed" in capsys.readouterr().err
    assert main(["run", *common, "--out", "runs/k"]) == 0  # the same command resumes
    assert "resuming" in capsys.readouterr().err
    assert main(["run", *common, "--out", "runs/whole"]) == 0
    assert _metrics(tmp_path / "runs" / "k") == _metrics(tmp_path / "runs" / "whole")


def test_failure_before_any_round_leaves_nothing_but_later_failure_keeps_rounds(tmp_path, monkeypatch):
    from fedskew.engine.loop import Simulation

    real = Simulation.round

    def fail_in_round_3(self, rnd):
        if rnd == 3:
            raise RuntimeError("boom")
        return real(self, rnd)

    monkeypatch.setattr(Simulation, "round", fail_in_round_3)
    with pytest.raises(RuntimeError, match="boom"):
        run_experiment(_cfg(tmp_path, checkpoint_every=1))
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed" and "boom" in status["error"] and status["completed_rounds"] == 2
    monkeypatch.setattr(Simulation, "round", real)
    out = run_experiment(_cfg(tmp_path, checkpoint_every=1), resume=True)
    assert [r["round"] for r in out.records] == [1, 2, 3, 4]


def test_a_damaged_lock_is_named_as_such(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").write_text("{garbage")
    with pytest.raises(RunDirError, match=r"its lock file .*\.lock is damaged \(it names no run holding it\)"):
        RunDirectory.prepare(tmp_path / "run")


def test_a_checkpoint_damaged_on_disk_is_refused_by_its_crc_and_a_kill_between_its_two_writes_is_not(tmp_path):
    """Issue 46: zeroed bytes inside checkpoint.pt loaded without a word (torch reads the damaged tensors) and the run
    finished with other numbers; the CRC-32 recorded in status.json when it was written now names it. The record
    keeps the previous checkpoint's CRC too, so a kill after the record but before the rename resumes."""
    values = {"clients": 4, "rounds": 4, "checkpoint_every": 1, "skew_probes": 0, "db": None}
    killed = {**values, "out": str(tmp_path / "run")}
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(killed, 2))
    child.start()
    child.join(120)
    run = tmp_path / "run"
    status = json.loads((run / "status.json").read_text())
    assert len(status["checkpoint_crc32"]) == 2  # round 2's checkpoint and round 1's
    good = (run / "checkpoint.pt").read_bytes()
    damaged = bytearray(good)
    damaged[len(good) // 2 : len(good) // 2 + 64] = bytes(64)
    (run / "checkpoint.pt").write_bytes(bytes(damaged))
    with pytest.raises(RunDirError, match=r"checkpoint of .* is damaged: its CRC-32 \(\w{8}\) is not the one recorded"):
        RunDirectory(run).load_checkpoint()
    # killed between recording a new CRC and renaming the new file into place: the old file's CRC is still listed
    (run / "checkpoint.pt").write_bytes(good)
    status["checkpoint_crc32"] = [12345, status["checkpoint_crc32"][0]]
    (run / "status.json").write_text(json.dumps(status))
    assert RunDirectory(run).load_checkpoint()["round"] == 2
    out = run_experiment(make_config(None, killed))
    assert out.summary["rounds"] == 4
