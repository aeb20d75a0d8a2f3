"""Which arithmetic produced a run's numbers is recorded with them, and a resume on other arithmetic is said
(engine/numerics.py)."""

import json
import multiprocessing
import os
import subprocess
import sys

import torch

import fedskew.runner
from fedskew.config import make_config
from fedskew.engine.numerics import PINS, continue_record, differences, numerics, processor
from fedskew.runner import run_experiment

VALUES = {"clients": 4, "rounds": 4, "checkpoint_every": 2, "skew_probes": 0, "db": None, "seed": 3}


def test_the_record_names_torch_its_cpu_kernels_and_the_processor(monkeypatch):
    for name in PINS:
        monkeypatch.delenv(name, raising=False)
    rec = numerics("cpu")
    kernels = torch.backends.cpu.get_cpu_capability()
    assert rec == {"torch": torch.__version__, "cpu_kernels": kernels, "cpu": processor()}
    assert processor() and processor() != "unknown"
    assert differences(rec, rec) == []
    assert differences({**rec, "from_round": 1}, {**rec, "from_round": 5}) == []  # the round marker is no change
    wider = "AVX512" if rec["cpu_kernels"] != "AVX512" else "AMX"
    assert differences({**rec, "cpu_kernels": wider}, rec) == [f"cpu_kernels {wider} -> {rec['cpu_kernels']}"]
    assert differences({"torch": "1"}, {"torch": "1", "gpu": "H200"}) == ["gpu - -> H200"]


def test_the_record_follows_the_kernels_torch_was_told_to_use():
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    code = "from fedskew.engine.numerics import numerics; print(numerics()['cpu_kernels'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "DEFAULT"


def test_the_record_names_the_variables_that_pin_a_librarys_code():
    """MKL (matrix products) and oneDNN (convolutions) choose their code apart from ATen's kernels: measured here, each
    of MKL_CBWR and ONEDNN_MAX_CPU_ISA alone changes a run's bits (docs/guide.md), so a set one is recorded."""
    env = {k: v for k, v in os.environ.items() if k not in PINS}
    code = "from fedskew.engine.numerics import numerics; print(numerics().get('pins', '-'))"
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert plain.stdout.strip() == "-"
    env.update(MKL_CBWR="AVX2", ONEDNN_MAX_CPU_ISA="AVX2")
    pinned = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert pinned.stdout.strip() == "MKL_CBWR=AVX2, ONEDNN_MAX_CPU_ISA=AVX2"


def test_a_record_from_before_the_processor_was_recorded_is_no_change():
    old = {"torch": "2", "cpu_kernels": "AVX2"}  # a summary.json written before `cpu` was recorded
    now = {**old, "cpu": "AMD EPYC 7B13"}
    assert differences(old, now) == [] and differences(now, old) == []
    assert differences({**now, "cpu": "Intel(R) Xeon(R) Processor"}, now) == [
        "cpu Intel(R) Xeon(R) Processor -> AMD EPYC 7B13"
    ]
    assert differences(old, {**now, "pins": "MKL_CBWR=AVX2"}) == ["pins - -> MKL_CBWR=AVX2"]  # a pin is a change
    assert continue_record([{"from_round": 1, **old}], 3, now)[1] == ""


def test_segments_open_only_when_the_arithmetic_changes():
    here = {"torch": "2", "cpu_kernels": "AVX2"}
    first, said = continue_record([], 1, here)
    assert first == [{"from_round": 1, **here}] and said == ""
    same, said = continue_record(first, 4, here)
    assert same == first and said == ""
    moved, said = continue_record(first, 4, {**here, "cpu_kernels": "AVX512"})
    assert moved == [*first, {"from_round": 4, "torch": "2", "cpu_kernels": "AVX512"}]
    assert "rounds 4 on" in said and "cpu_kernels AVX2 -> AVX512" in said


def test_summary_records_the_arithmetic(tmp_path):
    out = run_experiment(make_config(None, {**VALUES, "out": str(tmp_path / "run")}))
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["numerics"] == out.summary["numerics"] == [{"from_round": 1, **numerics()}]


def _killed_child(values: dict) -> None:
    def die(result):
        if result.record["round"] == 3:  # after the checkpoint of round 2
            os._exit(137)

    run_experiment(make_config(None, values), on_round=die)
    os._exit(0)


def test_a_resume_on_other_kernels_is_said_and_recorded(tmp_path, monkeypatch):
    values = {**VALUES, "out": str(tmp_path / "run")}
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(values,))
    child.start()
    child.join(120)
    assert child.exitcode == 137
    here = numerics()
    elsewhere = {**here, "cpu_kernels": "AVX512" if here["cpu_kernels"] != "AVX512" else "AVX2"}
    monkeypatch.setattr(fedskew.runner, "numerics", lambda device="cpu": elsewhere)
    notes: list[str] = []
    out = run_experiment(make_config(None, values), on_note=notes.append)
    assert out.summary["numerics"] == [{"from_round": 1, **here}, {"from_round": 3, **elsewhere}]
    said = [n for n in notes if "other arithmetic" in n]
    assert len(said) == 1 and f"cpu_kernels {here['cpu_kernels']} -> {elsewhere['cpu_kernels']}" in said[0]
    assert "rounds 3 on" in said[0]


def test_a_resume_on_the_same_kernels_keeps_one_segment(tmp_path):
    values = {**VALUES, "out": str(tmp_path / "run")}
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(values,))
    child.start()
    child.join(120)
    assert child.exitcode == 137
    notes: list[str] = []
    out = run_experiment(make_config(None, values), on_note=notes.append)
    assert out.summary["numerics"] == [{"from_round": 1, **numerics()}]
    assert not [n for n in notes if "other arithmetic" in n] and any("resuming" in n for n in notes)


def test_seeded_sections_of_the_global_rng_do_not_interleave_across_threads():
    """Runs in threads (engine/stacked_runs.py) draw their initial models from torch's global RNG under a seed: every
    such section holds one lock (seeding.global_rng), so each thread gets what it would get alone."""
    import threading

    from fedskew.seeding import global_rng

    def draw(seed):
        with global_rng(seed):
            return [torch.randn(64) for _ in range(50)]

    alone = {s: draw(s) for s in range(8)}
    got: dict[int, list] = {}

    def worker(s):
        for _ in range(5):
            got[s] = draw(s)
            assert all(torch.equal(a, b) for a, b in zip(got[s], alone[s], strict=True))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(all(torch.equal(a, b) for a, b in zip(got[s], alone[s], strict=True)) for s in range(8))
