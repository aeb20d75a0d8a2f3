"""``--stack-seeds auto`` (sweep/stack_choice.py, issue 47): each experiment's seeds stacked or run apart by what a
short probe measures faster; the rule, the sweep following the choice either way, a real probe that leaves nothing
behind, and runs too short to be worth a probe."""

import json

import pytest
from conftest import run_records

from fedskew.sweep.stack_choice import MIN_ROUNDS, StackChoice, choose_stacking, prefer_stacked, probe_group
from fedskew.sweep.task import Task, TaskGroup

BASE = {"dataset": "digits", "clients": 4, "join_ratio": 0.5, "skew_probes": 0, "threads": 1}


def test_the_rule_compares_a_round_of_all_seeds():
    assert prefer_stacked(1.0, 0.5, seeds=3, at_once=1)  # 1.0 s stacked against 3 x 0.5 s one after another
    assert not prefer_stacked(1.0, 0.5, seeds=2, at_once=2)  # both at once: 0.5 s
    assert prefer_stacked(1.0, 0.6, seeds=4, at_once=2)  # two waves of 0.6 s
    assert not prefer_stacked(2.0, 0.6, seeds=3, at_once=8)  # never more at once than seeds


def _task(name, seed, rounds=MIN_ROUNDS):
    return Task(name, {**BASE, "seed": seed, "rounds": rounds}, "new")


def test_groups_kept_or_split_in_place_and_each_choice_said():
    a = TaskGroup((_task("a0", 0), _task("a1", 1)))
    b = TaskGroup((_task("b0", 0), _task("b1", 1), _task("b2", 2)))
    lone = _task("c", 0)
    said = []

    def probe(group, jobs, emit):
        assert jobs == 3
        fast = group is a
        return StackChoice(fast, 1.0, 0.75 if fast else 0.2, min(jobs, len(group.tasks)), "test")

    units = choose_stacking([a, lone, b], 3, said.append, probe=probe)
    assert units == [a, lone, *b.tasks]
    notes = [ev[2] for ev in said if ev[0] == "note" and "takes" in ev[2]]
    assert len(notes) == 2
    assert "all 2 seeds takes 1 s stacked, 0.75 s as separate runs (2 at a time" in notes[0]
    assert notes[0].endswith(": stacked (test)")
    assert "all 3 seeds takes 1 s stacked, 0.2 s as separate runs (3 at a time" in notes[1]
    assert notes[1].endswith(": concurrent (test)")


def test_too_few_rounds_run_apart_unmeasured():
    group = TaskGroup((_task("a0", 0, rounds=3), _task("a1", 1, rounds=3)))
    choice = probe_group(group, 1)
    assert not choice.stacked and choice.stacked_s is None and "too few" in choice.reason


@pytest.mark.parametrize("jobs", [1, 2])  # 2: the separate runs in the sweep's worker processes
def test_a_real_probe_times_both_and_leaves_nothing(tmp_path, monkeypatch, jobs):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the probe's folder goes here, and must go again
    db = tmp_path / "never.db"
    group = TaskGroup(tuple(Task(f"s{s}", {**BASE, "seed": s, "rounds": MIN_ROUNDS, "db": str(db),
                                          "out": str(tmp_path / "real" / str(s))}, "new") for s in (0, 1)))  # fmt: skip
    choice = probe_group(group, jobs)
    assert choice.at_once == jobs
    assert choice.stacked_s is not None and choice.stacked_s > 0
    assert choice.concurrent_s is not None and choice.concurrent_s > 0
    assert choice.stacked == prefer_stacked(choice.stacked_s, choice.concurrent_s, 2, jobs)
    left = [p.name for p in tmp_path.iterdir() if not p.name.startswith("pymp-")]  # pymp-: multiprocessing's own
    assert left == []  # no probe folder, no database, nothing at the runs' own folders


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "apart"])
def test_the_sweep_follows_the_choice(tmp_path, monkeypatch, capsys, stacked):
    import fedskew.sweep.stack_choice as stack_choice
    from fedskew.cli import main

    def probe(group, jobs, emit):
        return StackChoice(stacked, 1.0, 1.0, 1, "chosen by the test")

    monkeypatch.setattr(stack_choice, "probe_group", probe)
    monkeypatch.setattr(stack_choice.choose_stacking, "__defaults__", (probe,))
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({"base": {**BASE, "rounds": 2}, "methods": ["fedavg"], "seeds": [0, 1]}))
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), "--out", str(out), "--db", str(tmp_path / "s.db"), "--stack-seeds", "auto"]) == 0
    got = capsys.readouterr()
    said = " ".join((got.out + got.err).split())  # the display may wrap the note
    assert f"{'stacked' if stacked else 'concurrent'} (chosen by the test)" in said
    configs = sorted(out.glob("*/config.yaml"))
    assert len(configs) == 2
    assert all(("batched_clients: true" in c.read_text()) == stacked for c in configs)
    if not stacked:  # run apart: exactly the plain runs
        from fedskew.config import make_config
        from fedskew.runner import run_experiment

        for c in configs:
            values = {**BASE, "rounds": 2, "db": None, "out": str(tmp_path / "plain" / c.parent.name)}
            values["seed"] = int(next(line.split(":")[1] for line in c.read_text().splitlines()
                                      if line.startswith("seed:")))  # fmt: skip
            run_experiment(make_config(None, values))
            assert run_records(tmp_path / "plain" / c.parent.name) == run_records(c.parent)


def test_a_probe_interrupted_stops_the_sweep_before_anything_runs(tmp_path, monkeypatch):
    import fedskew.sweep.stack_choice as stack_choice
    from fedskew.sweep.core import SweepSpec, expand, run_sweep
    from fedskew.sweep.task import RunResult

    def stopped(group, emit):
        return [RunResult(t.name, "interrupted", str(t.values["out"])) for t in group.tasks]

    monkeypatch.setattr(stack_choice, "execute_stacked", stopped)
    spec = SweepSpec(base={**BASE, "rounds": MIN_ROUNDS}, methods=["fedavg"], seeds=[0, 1])
    outcome = run_sweep(expand(spec, out=tmp_path / "sweep", db=None), jobs=1, stack_seeds="auto")
    assert outcome.interrupted and [r.status for r in outcome.results] == ["not started"] * 2
    assert not (tmp_path / "sweep").exists() or not any((tmp_path / "sweep").iterdir())
