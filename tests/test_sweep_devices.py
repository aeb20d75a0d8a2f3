"""`fedskew sweep --jobs N --device cuda` on a machine with several GPUs (issue 26, item 2): each worker process of
the local pool takes its own GPU, round-robin, without Ray. Checked without a GPU: the assignment, the count of
visible GPUs (torch.cuda.device_count monkeypatched) and what a worker hands to its runs."""

import multiprocessing as mp
import signal

import pytest

from fedskew.sweep import pool as sweep
from fedskew.sweep.core import Task
from fedskew.sweep.task import TaskGroup


def test_workers_take_the_gpus_round_robin():
    assert [sweep.worker_device("cuda", i, 3) for i in range(5)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:0", "cuda:1"]
    assert sweep.worker_device("cuda", 4, 1) == "cuda"  # one GPU: every worker shares it
    assert sweep.worker_device("cuda", 4, 0) == "cuda"
    assert sweep.worker_device("cuda:1", 0, 4) == "cuda:1"  # a device chosen by the user stays
    assert sweep.worker_device("cpu", 1, 4) == "cpu"


def test_gpus_are_counted_only_for_cuda_runs(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: calls.append(1) or 4)
    cpu = [Task("a", {"device": "cpu"}, "new")]
    assert sweep._visible_gpus(cpu) == 0 and not calls  # no CUDA call for a CPU sweep
    assert sweep._visible_gpus([*cpu, Task("b", {"device": "cuda"}, "new")]) == 4


def test_each_worker_gets_its_index_and_hands_its_gpu_to_its_runs(monkeypatch):
    counter = mp.get_context("spawn").Value("i", 0)
    old = signal.getsignal(signal.SIGINT)
    try:
        indices = []
        for _ in range(3):
            sweep._init_worker(None, counter, 2)
            indices.append(sweep._DEVICE)
    finally:
        signal.signal(signal.SIGINT, old)
    assert indices == [(0, 2), (1, 2), (2, 2)]

    seen = []

    def execute(unit, emit):
        seen.extend(t.values["device"] for t in (unit.tasks if isinstance(unit, TaskGroup) else [unit]))

    monkeypatch.setattr(sweep, "execute", execute)
    monkeypatch.setattr(sweep, "_QUEUE", type("Q", (), {"put": staticmethod(lambda ev: None)})())
    for index, device in [(1, "cuda"), (2, "cuda"), (1, "cpu"), (1, "cuda:0")]:
        monkeypatch.setattr(sweep, "_DEVICE", (index, 2))
        sweep._pool_task(Task("r", {"device": device, "out": "x"}, "new"))
    assert seen == ["cuda:1", "cuda:0", "cpu", "cuda:0"]
    # a group of stacked seeds goes to one worker: every member on that worker's GPU
    seen.clear()
    monkeypatch.setattr(sweep, "_DEVICE", (1, 2))
    sweep._pool_task(TaskGroup(tuple(Task(f"r{s}", {"device": "cuda", "out": f"x{s}"}, "new") for s in range(3))))
    assert seen == ["cuda:1"] * 3


@pytest.mark.parametrize(
    "device, gpus, expected",
    [
        (None, None, {"num_cpus": 1}),
        ("cuda", None, {"num_cpus": 1, "num_gpus": 1.0}),
        ("cuda", 0.25, {"num_cpus": 1, "num_gpus": 0.25}),
    ],
)
def test_a_ray_task_reserves_one_cpu_or_a_gpu_share(device, gpus, expected):
    from fedskew.sweep.ray import RayExecutor

    assert RayExecutor(device=device, gpus_per_run=gpus).resources({"device": "cpu", "threads": 1}) == expected


def test_a_ray_task_reserves_its_threads_and_needs_a_gpu_share_for_cuda():
    from fedskew.config import ConfigError
    from fedskew.sweep.ray import RayExecutor

    assert RayExecutor().resources({"device": "cpu", "threads": 3, "workers": 2}) == {"num_cpus": 3}
    with pytest.raises(ConfigError, match="gpus-per-run"):
        RayExecutor(gpus_per_run=0).resources({"device": "cuda"})


def test_default_runs_at_a_time_follow_the_devices():
    # the CPU: one at a time, without asking torch about CUDA (gpus=None would)
    assert sweep.default_jobs(["cpu", None]) == 1
    # CUDA: RUNS_PER_GPU per visible GPU (the level runs_per_gpu.py measured best), at most one per core
    assert sweep.RUNS_PER_GPU == 8
    assert sweep.default_jobs(["cuda"], gpus=1, cpus=16) == 8
    assert sweep.default_jobs(["cuda"], gpus=1, cpus=4) == 4
    assert sweep.default_jobs(["cuda", "cpu"], gpus=2, cpus=64) == 16
    assert sweep.default_jobs(["cuda"], gpus=0, cpus=16) == 1  # no GPU: the runs fail with their own clear error
    assert sweep.default_jobs(["cuda:1"], gpus=4, cpus=64) == 8  # one named GPU holds them all
    assert sweep.default_jobs(["cuda:0", "cuda:1"], gpus=4, cpus=64) == 16
    assert sweep.default_jobs(["cuda:0", "cuda"], gpus=4, cpus=64) == 32


def test_the_sweep_and_reproduce_say_which_default_they_took(tmp_path, monkeypatch, capsys):
    from fedskew.cli import main

    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: s\nbase: {{dataset: digits, rounds: 1, clients: 3}}\nout: {tmp_path / 'sw'}\n")
    seen = []
    monkeypatch.setattr(sweep, "default_jobs", lambda devices: seen.append(devices) or 5)
    assert main(["sweep", str(spec), "--dry-run"]) == 0
    assert "5 at a time (the default on CUDA; --jobs to change)" in capsys.readouterr().err
    assert seen == [["cpu"]]
    assert main(["sweep", str(spec), "--dry-run", "--jobs", "2"]) == 0
    assert "2 at a time;" in capsys.readouterr().err and len(seen) == 1  # a given --jobs is not second-guessed
    for bad in ("0", "-1"):  # refused, not taken as "the default"
        assert main(["sweep", str(spec), "--dry-run", "--jobs", bad]) != 0
        assert f"--jobs must be >= 1, got {bad}" in capsys.readouterr().err
        assert main(["reproduce", "feddisco", "--scale", "smoke", "--dry-run", "--jobs", bad]) != 0
        assert f"--jobs must be >= 1, got {bad}" in capsys.readouterr().err
    out = tmp_path / "rp"
    assert main(["reproduce", "feddisco", "--scale", "smoke", "--out", str(out), "--dry-run", "--rows", "fedavg"]) == 0
    assert "5 at a time (the default on CUDA" in capsys.readouterr().err and len(seen) == 2
