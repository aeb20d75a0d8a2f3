"""`fedskew sweep` (issue 16): spec expansion (cases, zip, grid, methods with their arguments, seeds), one database,
a finished run skipped, an interrupted one resumed exactly, a failing run listed without stopping the others, the
process pool."""

import json
import os
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import run_records

from fedskew.cli import main
from fedskew.config import ConfigError
from fedskew.results.store import ResultsDB
from fedskew.runner import RunInterrupted, run_experiment
from fedskew.sweep.core import SweepSpec, dump_spec, expand, load_spec, run_state, run_sweep

# a digits federation that runs in a fraction of a second
TINY = {"dataset": "digits", "clients": 4, "rounds": 3, "model": "mlp", "skew_probes": 0, "lr": 0.1, "batch_size": 64}


def _spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(textwrap.dedent(text))
    return path


# ---- expansion --------------------------------------------------------------------------------------------------
def test_expansion_crosses_cases_zip_grid_methods_and_seeds(tmp_path):
    spec = SweepSpec(
        name="x",
        base={**TINY, "method_args": {"weights": "uniform"}},
        cases=[{"partition": "dir", "alpha": 0.5}, {"partition": "pat", "classes_per_client": 2}],
        zip={"lr": [0.1, 0.01], "local_epochs": [1, 2]},
        grid={"batch_size": [10, 20]},
        methods=["fedavg", {"name": "fedprox", "args": {"mu": 0.1}}],
        seeds=2,
    )
    runs = expand(spec, out=tmp_path / "o")
    assert len(runs) == 2 * 2 * 2 * 2 * 2  # cases x zip x grid x methods x seeds
    assert len({r.name for r in runs}) == len(runs)
    assert [r.cfg.seed for r in runs[:16]] == [0] * 16  # seeds outermost
    # zip moves its keys together: lr 0.1 always with 1 local epoch
    assert {(r.cfg.lr, r.cfg.local_epochs) for r in runs} == {(0.1, 1), (0.01, 2)}
    prox = [r for r in runs if r.cfg.method == "fedprox"]
    assert len(prox) == 16 and all(r.cfg.method_args == {"weights": "uniform", "mu": 0.1} for r in prox)
    assert {(r.cfg.partition, r.cfg.alpha if r.cfg.partition == "dir" else 2) for r in runs} == {
        ("dir", 0.5),
        ("pat", 2),
    }
    assert all(r.cfg.db == str(tmp_path / "o" / "fedskew.db") for r in runs)
    assert all(Path(r.cfg.out).parent == tmp_path / "o" for r in runs)
    first = runs[0]
    assert first.point == {"seed": 0, "case": 0, "zip0": 0, "batch_size": 10, "method": 0}
    # the names are a function of the run: the same spec expands to the same folders
    assert [r.name for r in expand(spec, out=tmp_path / "o")] == [r.name for r in runs]


def test_method_args_on_the_grid_and_a_seed_list(tmp_path):
    spec = SweepSpec(base={**TINY, "method": "fedprox"}, grid={"method_args.mu": [0.0, 0.5]}, seeds=[3, 7])
    runs = expand(spec, out=tmp_path)
    assert [(r.cfg.seed, r.cfg.method_args) for r in runs] == [
        (3, {"mu": 0.0}),
        (3, {"mu": 0.5}),
        (7, {"mu": 0.0}),
        (7, {"mu": 0.5}),
    ]
    assert "mu-0.5" in runs[1].name and runs[1].name.endswith(runs[1].name[-6:])


def test_a_method_entry_carries_the_run_settings_its_method_needs(tmp_path):
    """FedFomo scores each client's validation split: its entry sets one; the other methods' runs keep none."""
    methods = [{"name": "fedfomo", "config": {"validation": 0.2}}, "fedavg"]
    runs = expand(SweepSpec(base=TINY, methods=methods, seeds=[0]), out=tmp_path)
    assert [(r.cfg.method, r.cfg.validation) for r in runs] == [("fedfomo", 0.2), ("fedavg", 0.0)]
    with pytest.raises(ConfigError, match="validation split"):
        expand(SweepSpec(base=TINY, methods=["fedfomo"], seeds=[0]), out=tmp_path)


def test_spec_round_trips_through_yaml(tmp_path):
    spec = SweepSpec(base=TINY, methods=[{"name": "fedprox+disco", "args": {"mu": 0.01}}, "fedavg"], seeds=[0])
    path = tmp_path / "s.yaml"
    path.write_text(dump_spec(spec))
    again = load_spec(path)
    assert [r.name for r in expand(again, out=tmp_path)] == [r.name for r in expand(spec, out=tmp_path)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("base: {rounds: 2, learning_rate: 0.1}\n", "learning_rate"),
        ("base: {rounds: 2}\ngrid: {lr: []}\n", "no values"),
        ("base: {rounds: 2}\nzip: {lr: [0.1, 0.2], alpha: [0.1]}\n", "one common length"),
        ("base: {rounds: 2, out: somewhere}\n", "set by the sweep"),
        ("base: {rounds: 2}\ngrid: {seed: [1, 2]}\n", "set by the sweep"),
        ("base: {rounds: 2}\nmethods: [{name: fedprox, args: {nu: 1}}]\n", "no hyper-parameter 'nu'"),
        ("bases: {rounds: 2}\n", "bases"),
        ("base: {rounds: 2}\nseeds: [1, 1]\n", "distinct"),
    ],
)
def test_bad_specs_are_refused_naming_the_problem(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        expand(load_spec(_spec(tmp_path, text)), out=tmp_path / "o")


# ---- running: skip, resume, failures ------------------------------------------------------------------------------
def test_finished_runs_are_skipped_and_an_interrupted_one_resumes_exactly(tmp_path, one_thread):
    spec = SweepSpec(base={**TINY, "checkpoint_every": 1}, methods=["fedavg", {"name": "fedprox", "args": {"mu": 0.1}}])
    runs = expand(spec, out=tmp_path / "sw")
    a, b = runs
    # interrupt b after its second round (a checkpoint after every round)
    stop = {"n": 0}

    def interrupt(result):
        stop["n"] += 1
        if stop["n"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(RunInterrupted):
        run_experiment(b.cfg, on_round=interrupt)
    assert run_state(a)[0] == "new"
    assert run_state(b) == ("resume", "after round 2")

    events = []
    first = run_sweep(runs, on_event=events.append)
    assert [(r.status, r.detail) for r in first.results] == [("finished", ""), ("finished", "resumed")]
    starts = {ev[1]: ev[2] for ev in events if ev[0] == "start"}
    assert starts == {a.name: 1, b.name: 3}  # b continued with round 3
    assert [ev[2] for ev in events if ev[0] == "round" and ev[1] == b.name] == [3]
    # the resumed run equals an uninterrupted one, round for round
    fresh = run_experiment(b.cfg.model_copy(update={"out": str(tmp_path / "fresh"), "db": None}))
    assert run_records(b.cfg.out) == run_records(fresh.run_dir)

    second = run_sweep(runs)  # everything is done: nothing runs again
    assert [r.status for r in second.results] == ["skipped", "skipped"]
    assert second.run_ids() == first.run_ids()
    # the spec grows (lr now varies): the runs done before keep their folders and are not run again
    grown = expand(spec.model_copy(update={"grid": {"lr": [0.1, 0.05]}}), out=tmp_path / "sw")
    assert len(grown) == 4 and "lr0.05" in grown[2].name
    assert [(r.cfg.out, run_state(r)[0]) for r in grown if r.cfg.lr == 0.1] == [
        (a.cfg.out, "done"),
        (b.cfg.out, "done"),
    ]
    assert all(run_state(r)[0] == "new" for r in grown if r.cfg.lr == 0.05)
    with ResultsDB(a.cfg.db) as db:
        assert sorted(r["run_id"] for r in db.runs()) == sorted(first.run_ids())


def test_a_failing_run_is_listed_and_the_others_finish(tmp_path, capsys, one_thread):
    empty = tmp_path / "no-data"
    empty.mkdir()
    spec = _spec(
        tmp_path,
        f"""
        base: {json.dumps(TINY)}
        cases:
          - {{dataset: mnist, data_dir: {empty}, clients: 4}}
          - {{dataset: digits}}
        methods: [fedavg, fedavg+disco]
        out: {tmp_path / "sw"}
        """,
    )
    assert main(["sweep", str(spec), "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert "4 runs: 2 failed, 2 finished" in out
    assert "2 run(s) failed" in err and "DatasetNotFoundError" in err and "not found" in err
    closing = err.split("2 run(s) failed", 1)[1]  # the list at the end names both, with their error
    assert closing.count("DatasetNotFoundError") == 2
    assert "| fedavg+disco |" in out and "| fedavg |" in out  # the table of the runs that finished
    assert "DatasetNotFoundError" in (tmp_path / "sw" / "failures.log").read_text()
    with ResultsDB(tmp_path / "sw" / "fedskew.db") as db:
        assert sorted(r["method"] for r in db.runs()) == ["fedavg", "fedavg+disco"]
    # a folder in the way is a failure of that run, named
    runs = expand(load_spec(spec))
    (Path(runs[0].cfg.out) / "mine.txt").parent.mkdir(parents=True)
    (Path(runs[0].cfg.out) / "mine.txt").write_text("not fedskew's")
    assert run_state(runs[0])[0] == "blocked"
    assert main(["sweep", str(spec), "--dry-run"]) == 0
    listing = capsys.readouterr().out
    assert "blocked" in listing and listing.count("skip") == 2


def test_runs_in_a_process_pool_report_their_rounds(tmp_path):
    spec = SweepSpec(base=TINY, methods=["fedavg", "fedprox"], seeds=[0])
    runs = expand(spec, out=tmp_path / "pool")
    events = []
    outcome = run_sweep(runs, jobs=2, on_event=events.append)
    assert [r.status for r in outcome.results] == ["finished", "finished"]
    for run in runs:
        assert [ev[2] for ev in events if ev[0] == "round" and ev[1] == run.name] == [1, 2, 3]
    with ResultsDB(runs[0].cfg.db) as db:
        assert len(db.runs()) == 2


def test_sweep_cli_prints_the_table_of_its_runs(tmp_path, capsys):
    spec = _spec(tmp_path, f"base: {json.dumps(TINY)}\ngrid: {{lr: [0.1, 0.05]}}\nseeds: 2\njobs: 1\n")
    assert main(["sweep", str(spec), "--quiet", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| fedavg")]
    assert len(rows) == 2 and all("| 2 (0,1) |" in r for r in rows)  # one row per lr, two seeds each
    assert yaml.safe_load(spec.read_text())["seeds"] == 2


def test_a_sweep_of_too_many_runs_is_refused_at_once_with_the_count(tmp_path):
    """Issue 46: ``seeds: 100000000`` made even ``--dry-run`` expand for ever; the count is refused before any run
    is built."""
    from fedskew.sweep.core import MAX_RUNS, SweepSpec, expand

    spec = SweepSpec(name="big", base={"dataset": "digits"}, methods=["fedavg", "fedprox"], seeds=100_000_000)
    with pytest.raises(ConfigError, match=r"200,000,000 runs \(100,000,000 seeds × 2 methods × 1 points\)"):
        expand(spec, out=tmp_path)  # from the count alone: no run is built
    assert len(expand(SweepSpec(name="ok", base={"dataset": "digits"}, seeds=3), out=tmp_path)) == 3 < MAX_RUNS


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="a zombie is told from /proc (Linux)")
def test_an_ended_unreaped_process_is_not_alive():
    """A zombie still answers signal 0; taken for alive, its stale lock would be waited for forever."""
    import subprocess
    import sys
    import time

    from fedskew.results.rundir import pid_alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert pid_alive(os.getpid())
    deadline = time.time() + 60
    while pid_alive(child.pid) and time.time() < deadline:  # it ends at once; nobody reaps it until wait()
        time.sleep(0.05)
    assert not pid_alive(child.pid)
    assert child.poll() == 0  # it was a zombie until now, not a reaped (reusable) pid
    assert not pid_alive(child.pid) and not pid_alive(0)


def test_a_folder_another_run_has_just_locked_is_waited_for_not_failed(tmp_path, one_thread):
    """The window CI hit in the test below: a run has locked its new folder and not yet written its status. The
    other sweep took the folder for a foreign one and failed the run; now it waits for the lock's holder, then (the
    holder gone without writing anything) takes the folder over and trains the run."""
    import socket
    import subprocess
    import sys

    runs = expand(SweepSpec(base=TINY, methods=["fedavg"], seeds=[0]), out=tmp_path / "sw")
    folder = Path(runs[0].cfg.out)
    folder.mkdir(parents=True)
    # the lock's holder lives until the sweep says it waits for it (then it ends, unreaped: a zombie until wait())
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    lock = {"pid": holder.pid, "host": socket.gethostname(), "since": "now"}
    (folder / ".lock").write_text(json.dumps(lock))
    assert run_state(runs[0]) == ("new", "another run is starting it")
    (folder / "mine.txt").write_text("not fedskew's")  # beside no lock, a foreign file still blocks
    (folder / ".lock").rename(folder / "lock.saved")
    assert run_state(runs[0])[0] == "blocked"
    (folder / "lock.saved").rename(folder / ".lock")
    (folder / "mine.txt").unlink()
    events = []

    def on_event(ev) -> None:
        events.append(ev)
        if ev[0] == "note" and "waiting" in ev[2] and holder.stdin and not holder.stdin.closed:
            holder.stdin.close()

    try:
        outcome = run_sweep(runs, on_event=on_event)
    finally:
        if holder.poll() is None:  # (the sweep failed before it waited)
            holder.kill()
        holder.wait(60)
    assert [r.status for r in outcome.results] == ["finished"], outcome.results
    assert any(ev[0] == "note" and f"pid {holder.pid}" in ev[2] and "waiting" in ev[2] for ev in events)
    assert json.loads((folder / "status.json").read_text())["status"] == "finished"
    assert not (folder / ".lock").exists()


def test_the_same_sweep_twice_at_once_finishes_every_run_once_and_both_succeed(tmp_path):
    """Issue 46: two identical sweeps at once both exited 1 though every run finished (each took the other's locked
    or just finished folders for failures). Now a run waits for the process holding its folder, then takes the
    folder's state as it is: each run is trained once, and both sweeps report every run."""
    import subprocess
    import sys

    spec = tmp_path / "s.yaml"
    spec.write_text("base: {rounds: 2, clients: 4, skew_probes: 0}\ngrid: {method: [fedavg, fedprox]}\nseeds: [0, 1]\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "fedskew.cli", "sweep", str(spec), "--out", str(out), "--quiet"]
    procs = [
        subprocess.Popen(
            [*cmd, "--db", str(tmp_path / f"{i}.db")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for text in outputs:
        assert "4 runs:" in text and "failed" not in text.split("4 runs:")[-1]
    finished = sum(text.split("4 runs:")[-1].count("finished") for text in outputs)
    assert finished >= 1
    runs = sorted(d for d in out.iterdir() if d.is_dir())
    assert len(runs) == 4
    for d in runs:
        assert json.loads((d / "status.json").read_text())["status"] == "finished"
        assert len((d / "metrics.jsonl").read_text().splitlines()) == 2  # trained once: no round written twice
