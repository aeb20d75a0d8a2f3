"""benchmarks/batched_clients.py's command line at toy size on the CPU: a noise-floor measurement without timed repeats
(the warm-up's figures, how a slow CPU measures the float32 floor of a large workload) and a refused repeat count."""

import collections
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_script

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "batched_clients.py"


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH), "--random-data", "--clients", "3", "--fraction", "0.01", "--device", "cpu", *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_noise_floor_without_timed_repeats_reports_the_warm_up():
    done = _bench("--repeats", "0", "--noise-floor")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    # the floor: the sequential loop from received models moved by one ulp, with its count of clients past 1e-5
    floor = re.search(r"one-ulp sequential (\S+) \((\d+)/3 clients > 1e-5\)", out)
    assert floor and float(floor.group(1)) >= 0, out
    assert "(the warm-up alone, no timed repeats;" in out and "repeat 1:" not in out


def test_a_negative_repeat_count_is_refused_by_name():
    done = _bench("--repeats", "-1")
    assert done.returncode == 2 and "--repeats must be 0 or more" in done.stderr


def _module():
    return load_script(BENCH, "batched_clients_bench")


def test_busy_time_is_the_union_of_the_kernels_spans():
    union = _module().union_seconds
    assert union([]) == 0.0
    # overlapping kernels on two streams count once, a kernel inside another adds nothing, a gap is idle
    spans = [(0.0, 100.0), (50.0, 150.0), (60.0, 70.0), (300.0, 350.0), (350.0, 360.0)]
    assert union(spans) == pytest.approx(210e-6)
    assert union(list(reversed(spans))) == pytest.approx(210e-6)  # in any order


def test_busy_time_off_a_gpu_says_why():
    bench = _module()
    assert bench.device_profile(torch.device("cpu"), lambda: None) == "not a GPU run"


def test_the_devices_work_is_summed_by_kernel_most_time_first():
    bench = _module()
    span = collections.namedtuple("span", "start end")
    event = collections.namedtuple("event", "name time_range")
    work = [event("gemm", span(0, 300)), event("relu", span(300, 350)), event("gemm", span(400, 600))]
    work.append(event("memcpy", span(600, 1000)))
    top = bench.top_work(work)
    assert top == [("gemm", pytest.approx(500e-6), 2), ("memcpy", pytest.approx(400e-6), 1), ("relu", 50e-6, 1)]
    lines = bench.DeviceProfile(0.00095, top).lines(2)
    assert len(lines) == 2 and "gemm" in lines[0] and "53%" in lines[0] and "x2" in lines[0]
