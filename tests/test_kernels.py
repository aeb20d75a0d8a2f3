"""The GPU kernel flags a run may set (engine/kernels.py: ``tf32``, ``cudnn_benchmark``): held for the run and put
back after it, shared by the runs of one process only when they agree, recorded with the run's arithmetic, and said
to be ignored off CUDA. The flags are plain attributes on a CPU build too, so all of this runs without a GPU."""

from __future__ import annotations

import threading

import pytest
import torch

from fedskew.cli import build_parser
from fedskew.commands.flags import config_from_args
from fedskew.config import ConfigError, make_config
from fedskew.engine import kernels
from fedskew.engine.kernels import current, device_kernels, ignored, set_kernels, wanted
from fedskew.engine.numerics import differences, numerics


@pytest.fixture
def torch_flags():
    """torch's flags as found, put back after the test whatever it did."""
    before = current()
    yield before
    kernels._apply(before)


def test_the_modes_set_both_tf32_flags_and_benchmark_only_turns_on():
    now = (True, False, False)  # torch's defaults
    assert wanted("torch", False, now) == now
    assert wanted("on", False, now) == (True, True, False)
    assert wanted("off", True, now) == (False, False, True)
    assert wanted("torch", False, (False, True, True)) == (False, True, True)  # the process's own choice stands
    with pytest.raises(ConfigError, match="tf32 must be one of torch, on, off, not 'fast'"):
        wanted("fast", False, now)


def test_a_run_on_cuda_holds_its_flags_and_puts_back_what_it_found(torch_flags):
    kernels._apply((True, False, False))
    with device_kernels("cuda", "on", True) as note:
        assert note == ""
        assert current() == (True, True, True)
    assert current() == (True, False, False)
    with pytest.raises(RuntimeError, match="boom"), device_kernels("cuda:1", "off"):
        assert current() == (False, False, False)
        raise RuntimeError("boom")
    assert current() == (True, False, False)  # put back on an error too


def test_runs_of_one_process_share_the_flags_only_when_they_agree(torch_flags):
    kernels._apply((True, False, False))
    inside, release = threading.Event(), threading.Event()

    def first() -> None:  # a stacked seed's run, in its own thread
        with device_kernels("cuda", "on", False):
            inside.set()
            release.wait(30)

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(30)
    try:
        with device_kernels("cuda", "on", False):  # the same settings: shared
            assert current() == (True, True, False)
        assert current() == (True, True, False)  # the first run still holds them: not put back under it
        refused = pytest.raises(ConfigError, match=r"asks for GPU kernel flags \(TF32 convolutions off, matmuls off")
        with refused, device_kernels("cuda", "off", False):
            pass
        assert current() == (True, True, False)
    finally:
        release.set()
        t.join(30)
    assert current() == (True, False, False)  # the last holder gone: what was found


def test_off_cuda_the_flags_are_left_alone_and_the_run_is_told(torch_flags):
    kernels._apply((True, False, False))
    assert ignored("cpu", "torch", False) == ""
    assert ignored("cuda", "on", True) == ""
    note = ignored("cpu", "on", True)
    assert note == "tf32 on and cudnn_benchmark: CUDA settings (TF32, cuDNN); this cpu run computes without them"
    with device_kernels("cpu", "on", True) as said:
        assert said == note and current() == (True, False, False)
    assert set_kernels("mps", "off") == "tf32 off: CUDA settings (TF32, cuDNN); this mps run computes without them"
    assert current() == (True, False, False)
    assert set_kernels("cuda", "off", True) == "" and current() == (False, False, True)


def test_the_flags_reach_a_run_from_the_command_line_and_a_cpu_run_says_it_ignores_them(tmp_path, monkeypatch):
    from fedskew import runner

    argv = ["run", "--rounds", "1", "--clients", "3", "--tf32", "on", "--cudnn-benchmark", "--out", str(tmp_path)]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert (cfg.tf32, cfg.cudnn_benchmark) == ("on", True)
    assert make_config(None, {}).tf32 == "torch" and not make_config(None, {}).cudnn_benchmark
    with pytest.raises(ConfigError, match="tf32"):
        make_config(None, {"tf32": "fast"})
    assert cfg.identity() == make_config(None, {"rounds": 1, "clients": 3}).identity()  # how fast, not what

    held = []
    real = runner.device_kernels
    monkeypatch.setattr(runner, "device_kernels", lambda *a: held.append(a) or real(*a))
    notes: list[str] = []
    cfg = make_config({"db": None}, {"rounds": 1, "clients": 3, "skew_probes": 0, "tf32": "on", "out": str(tmp_path)})
    runner.run_experiment(cfg, on_note=notes.append)
    assert held == [("cpu", "on", False)]
    assert "tf32 on: CUDA settings (TF32, cuDNN); this cpu run computes without them" in notes


def test_a_cuda_runs_arithmetic_record_names_its_flags(torch_flags, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    kernels._apply((True, False, False))
    before = numerics("cuda")
    assert before["gpu"] == "a GPU"
    assert (before["tf32"], before["cudnn_benchmark"]) == ("convolutions on, matmuls off", "off")
    with device_kernels("cuda", "on", True):
        now = numerics("cuda")
    assert differences(before, now) == [
        "cudnn_benchmark off -> on",
        "tf32 convolutions on, matmuls off -> convolutions on, matmuls on",
    ]
    old = {k: v for k, v in before.items() if k not in ("tf32", "cudnn_benchmark")}  # a record from before them
    assert differences(old, now) == []
    assert "tf32" not in numerics("cpu")
