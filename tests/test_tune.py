"""fedskew tune: search spaces, tuned.yaml, the search on validation data (never a test sample), pruning, resuming
after a kill, and sweeps that apply the tuned arguments."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from fedskew.config import ConfigError, make_config
from fedskew.registry import CLIENTS, SERVER_PLUGINS
from fedskew.space import Choice, Float, Int, parse_dist
from fedskew.tuning.method_space import method_space
from fedskew.tuning.tuned import TunedEntry, apply_tuned, canonical_method, load_tuned, setting_of, write_tuned

optuna = pytest.importorskip("optuna", reason="fedskew tune needs the optional extra fedskew[tune] (optuna)")

from fedskew.tuning import study as tune_study  # noqa: E402

TINY = {"rounds": 3, "clients": 4, "eval_every": 1, "checkpoint_every": 1}


# ---- search spaces -------------------------------------------------------------------------------------------
def test_override_strings():
    assert parse_dist("0.1..0.9") == Float(0.1, 0.9)
    assert parse_dist("log:1e-4..1") == Float(1e-4, 1.0, log=True)
    assert parse_dist("int:1..10") == Int(1, 10)
    assert parse_dist("intlog:1..256") == Int(1, 256, log=True)
    assert parse_dist("[0.01, 0.1, 1]") == Choice((0.01, 0.1, 1))
    assert parse_dist("none") is None and parse_dist("fixed") is None
    for bad, why in [
        ("0.9..0.1", "low < high"),
        ("log:0..1", "log range needs low > 0"),
        ("abc", "expected LOW..HIGH"),
        ("cube:1..2", "unknown kind"),
        ("int:1.5..3", "bounds must be numbers"),
        ("[1, 1]", "distinct"),
    ]:
        with pytest.raises(ConfigError, match=why):
            parse_dist(bad)


def test_method_space_qualifies_shared_keys_and_takes_overrides():
    space = method_space("moon+heal")
    assert set(space) == {"mu", "moon.tau", "heal.tau", "beta"}  # tau is both MOON's and HEAL's
    space = method_space("fedprox+disco", {"lr": parse_dist("log:0.001..0.1"), "b": None, "mu": parse_dist("[0.1, 1]")})
    assert space == {"mu": Choice((0.1, 1)), "a": Float(0.1, 1.0), "lr": Float(0.001, 0.1, log=True)}
    assert method_space("fedavg") == {}  # nothing to tune: FedAvg runs once, the reference
    with pytest.raises(ConfigError, match="ambiguous"):
        method_space("moon+heal", {"tau": parse_dist("0.1..0.5")})


def test_every_declared_range_is_valid_for_its_part():
    """Each part's tunable keys are its hyper-parameters, and both ends of every range validate in its settings model
    (a range outside a field's bounds would make trials fail)."""
    parts = list(CLIENTS.values()) + list(SERVER_PLUGINS.values())
    assert sum(bool(p.tunable) for p in parts) >= 12
    for part in parts:
        for key, dist in part.tunable.items():
            assert key in part.params.model_fields, (part.name, key)
            ends = dist.values if isinstance(dist, Choice) else (dist.low, dist.high)
            for v in ends:
                part.params(**{key: v})  # raises if outside the field's bounds


def test_the_papers_baselines_declare_their_hyper_parameters():
    for method, keys in {
        "fedprox": {"mu"},
        "moon": {"mu", "tau"},
        "feddyn": {"alpha"},
        "feddc": {"alpha"},
        "fedavg+fedavgm": {"server_momentum"},
        "fedavg+disco": {"a", "b"},
        "fedavg+heal": {"tau", "beta"},
        "fedsa": {"lam", "C", "S"},
        "fedcac": {"tau", "beta"},
        "ditto": {"lam"},
    }.items():
        assert keys <= set(method_space(method)), method


# ---- tuned.yaml --------------------------------------------------------------------------------------------------
def _entry(method="fedprox", args=None, run=None, **setting):
    cfg = make_config(None, {"method": method, **TINY, "db": None}).model_dump()
    return TunedEntry(method, {**setting_of(cfg, exclude=tuple(run or {})), **setting}, args or {}, run or {})


def test_tuned_file_round_trip_merge_and_match(tmp_path):
    path = tmp_path / "tuned.yaml"
    write_tuned(path, [_entry(args={"mu": 0.3}), _entry("fedavg")])
    write_tuned(path, [_entry(args={"mu": 0.05})])  # the same method and setting: replaced, the other kept
    entries = load_tuned(path)
    assert [(e.method, e.args) for e in entries] == [("fedavg", {}), ("fedprox", {"mu": 0.05})]
    values = {"method": "fedprox", **TINY, "db": None}
    out, took = apply_tuned(values, entries)
    assert out["method_args"] == {"mu": 0.05} and took["args"] == {"mu": 0.05}
    out, took = apply_tuned({**values, "method_args": {"mu": 0.7}}, entries)  # explicit arguments win
    assert out["method_args"] == {"mu": 0.7} and took["args"] == {}
    out, took = apply_tuned({**values, "alpha": 0.5}, entries)  # another setting: untouched
    assert took is None and out == {**values, "alpha": 0.5}
    out, took = apply_tuned({**values, "rounds": 50}, entries)  # rounds are not part of a setting
    assert took is not None


def test_tuned_run_level_settings_replace_the_base(tmp_path):
    path = tmp_path / "tuned.yaml"
    write_tuned(path, [_entry(args={"mu": 0.1}, run={"lr": 0.02})])
    out, took = apply_tuned({"method": "fedprox", **TINY, "lr": 0.3, "db": None}, load_tuned(path))
    assert out["lr"] == 0.02 and took["run"] == {"lr": 0.02}


def test_tuned_file_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tuned: [{method: fedprox, run: {rounds: 3}}]")
    with pytest.raises(ConfigError, match="run-level keys"):
        load_tuned(bad)
    bad.write_text("tuned: [{method: nosuch}]")
    with pytest.raises(ConfigError, match="entry 0.*unknown part 'nosuch'"):
        load_tuned(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_tuned(tmp_path / "missing.yaml")
    assert canonical_method("fedpake") == "fedavg+fedsa" and canonical_method("fedrep") == "fedrep"


# ---- the search --------------------------------------------------------------------------------------------------
def _spec(tmp_path, methods, trials=2, **extra):
    base = {**TINY, **extra.pop("base", {})}
    return tune_study.load_tune_spec(
        None, {"methods": methods, "base": base, "trials": trials, "out": str(tmp_path / "tune"), **extra}
    )


def test_tune_fedprox_qffl_afl_writes_tuned_yaml_trials_and_figures(tmp_path):
    spec = _spec(tmp_path, ["fedprox", "qffl", "fedavg+afl"])
    results = tune_study.tune(spec)
    assert [r.best.method for r in results] == ["fedprox", "fedavg+qffl", "fedavg+afl"]
    entries = load_tuned(spec.tuned_path)
    assert {e.method for e in entries} == {"fedprox", "fedavg+qffl", "fedavg+afl"}
    prox = next(e for e in entries if e.method == "fedprox")
    assert set(prox.args) == {"mu"} and 1e-3 <= prox.args["mu"] <= 1.0
    assert prox.extra["metric"] == "global_acc" and prox.extra["trials"]["complete"] == 2
    with sqlite3.connect(spec.db_path) as conn:
        rows = conn.execute("SELECT study, number, state, value FROM trials ORDER BY study, number").fetchall()
    assert len(rows) == 6 and all(state == "complete" and 0 <= value <= 1 for _, _, state, value in rows)
    assert all(r.figure is not None and r.figure.is_file() and r.figure.with_suffix(".json").is_file() for r in results)
    # the same command again: the budget is spent, nothing runs, the same best arguments
    again = tune_study.tune(spec)
    assert [r.counts["complete"] for r in again] == [2, 2, 2]
    assert load_tuned(spec.tuned_path)[0].args == entries[0].args


def test_a_sweep_runs_the_tuned_arguments(tmp_path):
    from fedskew.sweep.core import SweepSpec, expand, run_sweep

    spec = _spec(tmp_path, ["fedprox"])
    tune_study.tune(spec)
    mu = load_tuned(spec.tuned_path)[0].args["mu"]
    out, tuned = str(tmp_path / "sw"), str(spec.tuned_path)
    sweep = SweepSpec(name="s", base=TINY, methods=["fedprox", "fedavg"], seeds=[1], out=out, tuned=tuned)
    runs = expand(sweep)
    prox = next(r for r in runs if r.cfg.method == "fedprox")
    assert prox.cfg.method_args == {"mu": mu} and prox.tuned["args"] == {"mu": mu}
    assert next(r for r in runs if r.cfg.method == "fedavg").tuned is None  # no entry: its defaults
    outcome = run_sweep(runs)
    assert [r.status for r in outcome.results] == ["finished", "finished"]
    saved = yaml.safe_load((Path(prox.cfg.out) / "config.yaml").read_text())
    assert saved["method_args"] == {"mu": mu} and saved["evaluate_on"] == "test" and saved["validation"] == 0.0


def test_no_test_sample_is_read_while_tuning(tmp_path, monkeypatch):
    """Every federation a trial runs on is recorded; none holds a sample of the test sets (local or global) of the
    federation the final runs use, by source index."""
    import fedskew.data.federated as fed
    import fedskew.runner as runner

    seen = []

    def recording(cfg, dataset=None):
        data = fed.build_federated(cfg, dataset)
        seen.append((cfg, data))
        return data

    monkeypatch.setattr(runner, "build_federated", recording)
    spec = _spec(tmp_path, ["fedprox", "fedavg+afl"], trials=2, seeds=[0, 1])
    tune_study.tune(spec)
    assert len(seen) == (2 + 2) * 2  # (2 trials of each method) x 2 seeds
    for cfg, data in seen:
        assert cfg.evaluate_on == "validation" and cfg.validation == 0.2
        final = fed.build_federated(cfg.model_copy(update={"validation": 0.0, "evaluate_on": "test"}))
        tests = np.concatenate([final.test_index, *(c.test_index for c in final.clients)])
        read = np.concatenate(
            [data.test_index, *(c.train_index for c in data.clients), *(c.test_index for c in data.clients)]
        )
        assert len(read) and not np.isin(read, tests).any()


def test_pruned_run_stops_keeps_its_rounds_and_resumes(tmp_path):
    cfg = make_config(None, {**TINY, "rounds": 5, "validation": 0.2, "evaluate_on": "validation", "db": None})
    cfg = cfg.model_copy(update={"out": str(tmp_path / "run")})
    seen = []

    def report(rnd, value):
        seen.append(rnd)
        if rnd == 2:
            raise tune_study.Pruned

    with pytest.raises(tune_study.Pruned):
        tune_study.run_trial_run(cfg, report, "global_acc")
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "stopped" and status["completed_rounds"] == 2 and seen == [1, 2]
    seen.clear()  # resumed after round 2: its first rounds are reported again (replayed), then the new ones
    summary = tune_study.run_trial_run(cfg, lambda r, v: seen.append(r), "global_acc")
    assert seen == [1, 2, 3, 4, 5] and summary["rounds"] == 5
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3, 4, 5]
    seen.clear()  # done: nothing runs, the whole curve is replayed
    assert tune_study.run_trial_run(cfg, lambda r, v: seen.append(r), "global_acc")["rounds"] == 5
    assert seen == [1, 2, 3, 4, 5]


def test_pruning_stops_trials_that_trail(tmp_path):
    """With lr as a search dimension spanning useless values, the median rule stops some trials early."""
    spec = _spec(
        tmp_path,
        ["fedavg"],
        trials=8,
        base={"rounds": 6},
        space={"lr": "[0.05, 0.0001]"},
        warmup_rounds=1,
    )
    (result,) = tune_study.tune(spec)
    assert result.counts["pruned"] >= 1 and result.counts["complete"] + result.counts["pruned"] == 8
    assert result.best.run == {"lr": 0.05}
    pruned = [r for r in result.trials if r["state"] == "pruned"]
    assert all(r["value"] is None and r["last_step"] < 6 and r["last_value"] is not None for r in pruned)
    figure = json.loads(result.figure.with_suffix(".json").read_text())
    assert sum(r["state"] == "pruned" for r in figure["trials"]) == len(pruned)


def test_bad_tune_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="none of the methods"):
        _spec(tmp_path, ["fedprox"], space={"nosuch": "0.1..1"})
    with pytest.raises(ConfigError, match="set by the search itself"):
        _spec(tmp_path, ["fedprox"], base={"seed": 3})
    with pytest.raises(ConfigError, match="unknown part"):
        _spec(tmp_path, ["fedprox+nosuch"])
    spec = _spec(tmp_path, ["fedprox"])
    tune_study.tune(spec)
    other = _spec(tmp_path, ["fedprox"], space={"mu": "0.1..0.5"})  # same study name, another space
    with pytest.raises(ConfigError, match="another base, search space or objective"):
        tune_study.tune(other)


def test_tune_resumes_after_a_kill(tmp_path):
    """`fedskew tune` killed (SIGKILL) while a trial runs: the same command retries that trial with the same
    arguments, its run resumes from its checkpoint, and the search ends with its full budget."""
    out = tmp_path / "tune"
    cmd = [
        sys.executable, "-m", "fedskew.cli", "tune", "--methods", "fedprox", "--trials", "2", "--rounds", "40",
        "--clients", "4", "--checkpoint-every", "1", "--out", str(out), "--quiet",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 240
    killed_dir = None
    while time.time() < deadline and killed_dir is None:
        for status in out.glob("trials/*/*/status.json"):
            st = json.loads(status.read_text())
            if st.get("status") == "running" and (st.get("checkpoint_round") or 0) >= 3:
                killed_dir = status.parent
        time.sleep(0.2)
    assert killed_dir is not None, proc.stderr.read().decode() if proc.poll() is not None else "no trial checkpointed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = json.loads((killed_dir / "status.json").read_text())["checkpoint_round"]
    assert done_before < 40

    from fedskew.cli import main

    assert main(cmd[3:]) == 0
    st = optuna.load_study(study_name="tune:fedprox", storage=f"sqlite:///{(out / 'optuna.db').resolve()}")
    states = [t.state.name for t in st.trials]
    assert states.count("COMPLETE") == 2 and states.count("FAIL") == 1  # the killed trial, retried once
    retry = next(t for t in st.trials if t.system_attrs.get("retry_history"))
    killed = st.trials[retry.system_attrs["failed_trial"]]
    assert retry.params == killed.params and retry.state.name == "COMPLETE"
    assert retry.user_attrs["run_dirs"] == [str(killed_dir)]
    records = [json.loads(line) for line in (killed_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(1, 41))  # resumed: every round once
    assert load_tuned(out / "tuned.yaml")[0].method == "fedprox"


def test_a_resumed_search_does_not_redraw_the_first_arguments(tmp_path):
    """A search continued later samples from a stream of its own: while TPE is in its random start, the first search's
    seed would draw the first trials' arguments again (seen: a resumed MOON search re-ran mu 0.0693)."""
    from optuna.distributions import FloatDistribution

    spec = _spec(tmp_path, ["fedprox"], trials=8)
    entry = spec.method_entries()[0]
    space = {"mu": FloatDistribution(1e-4, 1.0, log=True)}
    study, _, _ = tune_study.open_study(spec, entry)
    first = study.ask(space)
    study.tell(first, 0.5)
    resumed, _, _ = tune_study.open_study(spec, entry)
    again = resumed.ask(space)
    assert again.params != first.params
    fresh, _, _ = tune_study.open_study(_spec(tmp_path / "b", ["fedprox"], trials=8), entry)
    assert fresh.ask(space).params == first.params  # a new search is reproducible: the same first draw


def test_sigterm_to_a_parallel_search_stops_its_workers(tmp_path):
    """`fedskew tune --jobs 2` sent SIGTERM (the parent alone, as `kill PID` does): the workers, which ignore SIGINT and
    are children of the fork server, get it too; their trials checkpoint, are marked interrupted, and no worker runs
    on (seen: orphaned workers went on training for half an hour beside the next search)."""
    from fedskew.results.rundir import pid_alive

    out = tmp_path / "tune"
    cmd = [
        sys.executable, "-m", "fedskew.cli", "tune", "--methods", "fedprox", "--trials", "4", "--jobs", "2",
        "--rounds", "400", "--clients", "4", "--checkpoint-every", "1", "--out", str(out), "--quiet",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 240
        running = []
        while time.time() < deadline and len(running) < 2 and proc.poll() is None:
            states = [json.loads(f.read_text()) for f in out.glob("trials/*/*/status.json")]
            running = [st for st in states if st.get("status") == "running" and (st.get("checkpoint_round") or 0) >= 2]
            time.sleep(0.2)
        assert len(running) == 2, proc.stderr.read().decode() if proc.poll() is not None else "no two trials running"
        os.kill(proc.pid, signal.SIGTERM)
        err = proc.communicate(timeout=120)[1].decode()
        assert "interrupted: finished trials are kept" in err, err[-3000:]
        study = optuna.load_study(study_name="tune:fedprox", storage=f"sqlite:///{out / 'optuna.db'}")
        workers = {t.user_attrs["pid"] for t in study.trials}
        assert len(workers) == 2 and sum(bool(t.user_attrs.get("interrupted")) for t in study.trials) == 2
        deadline = time.time() + 30
        while time.time() < deadline and any(pid_alive(pid) for pid in workers):
            time.sleep(0.2)
        assert not any(pid_alive(pid) for pid in workers)
        for f in out.glob("trials/*/*/status.json"):  # both runs stopped at a checkpoint, well before their end
            st = json.loads(f.read_text())
            assert st["status"] != "running" and st["checkpoint_round"] < 400
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_two_processes_tune_one_study(tmp_path):
    """--jobs 2: two processes share the study through its storage; the budget is met (at most one trial over, when
    both started one together) and every trial is recorded once."""
    spec = _spec(tmp_path, ["fedprox"], trials=3, jobs=2)
    (result,) = tune_study.tune(spec)
    done = result.counts["complete"] + result.counts["pruned"]
    assert 3 <= done <= 4 and result.counts["fail"] == 0 and result.best is not None
    with sqlite3.connect(spec.db_path) as conn:
        numbers = [n for (n,) in conn.execute("SELECT number FROM trials ORDER BY number")]
    assert numbers == list(range(done))
    pids = {t.user_attrs["pid"] for t in optuna.load_study(study_name="tune:fedprox", storage=spec.storage_url).trials}
    assert len(pids) == 2 and os.getpid() not in pids


def _pop_queued(url: str, start: float, out) -> None:  # a process of the test below
    from fedskew.tuning.storage import open_storage

    study = optuna.load_study(study_name="q", storage=open_storage(url))
    while time.time() < start:  # every process asks at once
        pass
    claimed = []
    while (trial_id := study._pop_waiting_trial_id()) is not None:
        claimed.append(trial_id)
    out.put(claimed)


def test_a_queued_trial_is_claimed_by_one_process(tmp_path):
    """Retried trials are queued; on an SQLite file (no row locks) two --jobs workers could both claim one and run it
    twice (seen: 4 processes claimed 40 queued trials 47 to 51 times). The storage serializes the claims."""
    import multiprocessing as mp

    from fedskew.tuning.storage import open_storage

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="q", storage=open_storage(url))
    for i in range(40):
        study.enqueue_trial({"x": i})
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    start = time.time() + 4
    procs = [ctx.Process(target=_pop_queued, args=(url, start, queue)) for _ in range(4)]
    for proc in procs:
        proc.start()
    claimed = [queue.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join()
    every = sorted(t for c in claimed for t in c)
    assert every == sorted(t._trial_id for t in study.get_trials()), [len(c) for c in claimed]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed (extra [ray])")
@pytest.mark.xdist_group("ray")  # one local Ray cluster at a time
def test_ray_tasks_tune_one_study(tmp_path):
    """`fedskew tune --executor ray --jobs 2` (its own process, as a user runs it; a local Ray instance of 2 CPUs): the
    budget is met, every trial recorded once, the trials ran in two processes other than the command's, and the same
    command again runs nothing."""
    out = tmp_path / "tune"
    argv = [sys.executable, "-m", "fedskew", "tune", "--methods", "fedprox", "--trials", "3", "--jobs", "2"]
    argv += ["--executor", "ray", "--rounds", "3", "--clients", "4", "--checkpoint-every", "1", "--out", str(out)]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert "run as Ray tasks on a local Ray instance" in first.stderr
    study = optuna.load_study(study_name="tune:fedprox", storage=f"sqlite:///{out / 'optuna.db'}")
    done = [t for t in study.trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert 3 <= len(done) <= 4 and not [t for t in study.trials if t.state.name == "FAIL"]
    with sqlite3.connect(out / "fedskew.db") as conn:
        numbers = [n for (n,) in conn.execute("SELECT number FROM trials ORDER BY number")]
    assert numbers == list(range(len(done)))
    assert len({t.user_attrs["pid"] for t in study.trials}) == 2
    assert (out / "tuned.yaml").exists()
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    reloaded = optuna.load_study(study_name="tune:fedprox", storage=f"sqlite:///{out / 'optuna.db'}")
    assert again.returncode == 0 and len(reloaded.trials) == len(study.trials)


def test_an_unknown_metric_is_refused_before_any_trial(tmp_path, capsys):
    """Issue 46: it was refused after the first trial had run, with a traceback."""
    from fedskew.cli import main

    rc = main(
        [
            "tune",
            "--methods",
            "fedavg",
            "--metric",
            "nope",
            "--trials",
            "1",
            "--rounds",
            "1",
            "--out",
            str(tmp_path / "t"),
        ]
    )
    assert rc == 2 and "metric 'nope' is not one a run reports" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_tune_prints_accuracies_in_percent_as_run_and_report_do(tmp_path, capsys):
    """Issue 45: the tune table printed fractions (0.9729) where run and report print percentages."""
    from fedskew.cli import main
    from fedskew.commands.tune import shown_value

    assert shown_value(0.97293, "global_acc") == "97.29%" and shown_value(0.5, "domain_acc_std") == "50.00%"
    assert shown_value(0.25, "train_loss") == "0.2500"
    args = ["tune", "--methods", "fedprox", "--trials", "2", "--rounds", "2", "--clients", "3"]
    assert main([*args, "--out", str(tmp_path / "t")]) == 0
    out = capsys.readouterr().out
    table = out[out.index("best on the validation splits") :]
    assert any("%" in line and "fedprox" in line for line in table.splitlines())  # the best value, in percent


@pytest.mark.parametrize(
    "url, said",
    [
        ("bogus://x", "'bogus' is not a database SQLAlchemy knows"),
        ("postgresql://user@localhost/db", "its database driver is not installed"),
    ],
)
def test_an_unusable_storage_url_is_one_error_line(tmp_path, capsys, url, said):
    from fedskew.cli import main

    if url.startswith("postgresql") and importlib.util.find_spec("psycopg2") is not None:
        pytest.skip("psycopg2 is installed here: the URL would reach for a server instead")
    args = ["tune", "--methods", "fedprox", "--trials", "1", "--rounds", "1", "--clients", "4"]
    assert main([*args, "--storage", url, "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
    assert not (tmp_path / "t" / "tuned.yaml").exists()


def test_an_interrupted_trial_is_reported_without_optunas_traceback():
    import logging

    from fedskew.runner import RunInterrupted
    from fedskew.tuning.study import _InterruptedTrials

    def record(msg, exc=None):
        info = (type(exc), exc, None) if exc is not None else None
        return logging.LogRecord("optuna.study._optimize", logging.WARNING, __file__, 1, msg, None, info)

    quiet = _InterruptedTrials()
    assert quiet.filter(record("Trial 3 failed with parameters: {}", ValueError("a real bug")))  # kept
    assert quiet.filter(record("Trial 3 failed with value None."))  # kept: nothing was interrupted
    interrupted = RunInterrupted(signal.SIGINT, Path("run"), 2)
    assert not quiet.filter(record("Trial 4 failed with parameters: {}", interrupted))
    assert not quiet.filter(record("Trial 4 failed with value None."))
    assert quiet.filter(record("Trial 5 finished with value: 0.5"))
