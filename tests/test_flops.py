"""benchmarks/flops.py: the run book's arithmetic counts, computed wherever the run trained."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from flops import macs_per_sample, run_arithmetic  # noqa: E402

from fedskew.config import make_config  # noqa: E402
from fedskew.models import build_model  # noqa: E402
from fedskew.runner import run_experiment  # noqa: E402


def test_macs_are_counted_on_the_models_device_whatever_the_inputs():
    model = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    expected = 64 * 200 + 200 * 200 + 200 * 10  # Linear layers: in x out multiply-adds a sample
    x = torch.zeros(3, 1, 8, 8)
    assert macs_per_sample(model, x) == expected
    # inputs on another device than the model (a run's data on the GPU, the counting model on the CPU): moved over;
    # the meta device stands in for the other device here
    assert macs_per_sample(model.to("meta"), x) == expected


def test_a_runs_arithmetic_is_counted_on_the_cpu_even_when_it_trained_on_a_gpu(tmp_path):
    out = tmp_path / "run"
    run_experiment(make_config(None, {"rounds": 2, "clients": 4, "db": None, "skew_probes": 0, "out": str(out)}))
    here = run_arithmetic(out)
    cfg = out / "config.yaml"
    text = cfg.read_text()
    assert "device: cpu" in text
    cfg.write_text(text.replace("device: cpu", "device: cuda"))  # as a run on a GPU records it
    assert run_arithmetic(out) == here
    assert here["macs_per_sample"] > 0 and here["rounds"] == 2.0 and here["train_gflop"] > 0
