"""``channels_last``: convolutions in channels-last memory order give the default layout's results up to float32
rounding, for every kind of method (client objectives, masks, control variates, personal models, BatchNorm)."""

import json

import pytest
import torch

from fedskew.config import make_config
from fedskew.runner import run_experiment


def _records(run_dir):
    return [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("method", "model"),
    [
        ("fedavg", "cnn"),
        ("scaffold+heal", "cnn"),
        ("moon", "cnn"),
        ("fedcac", "lenet_bn"),
        ("fedsa", "cnn"),
        ("fedbn", "lenet_bn"),
        ("fedrep", "lenet"),
    ],
)
def test_channels_last_gives_the_default_layouts_numbers(tmp_path, one_thread, method, model):
    base = {"clients": 4, "rounds": 2, "method": method, "model": model, "db": None, "seed": 5, "skew_probes": 0}
    ref = _records(run_experiment(make_config(None, {**base, "out": str(tmp_path / "a")})).run_dir)
    cl = _records(
        run_experiment(make_config(None, {**base, "out": str(tmp_path / "b"), "channels_last": True})).run_dir
    )
    for a, b in zip(ref, cl, strict=True):
        for key in ("global_local_acc", "personal_acc", "global_acc"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=0.02), key  # a few test samples may flip
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-3)


def test_channels_last_model_keeps_its_layout_through_load_state_dict(one_thread):
    from conftest import digits_simulation

    sim = digits_simulation("fedavg", model="cnn", channels_last=True)
    conv = [p for p in sim.model.parameters() if p.dim() == 4]
    assert conv and all(p.is_contiguous(memory_format=torch.channels_last) for p in conv)
    assert any(not p.is_contiguous() for p in conv)  # the layers with more than one input channel
    sim.round(1)
    sim.model.load_state_dict(sim.global_params)
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in sim.model.parameters() if p.dim() == 4)


def test_channels_last_runs_are_reproducible_and_workers_match(tmp_path, one_thread):
    base = {"clients": 4, "rounds": 2, "model": "cnn", "db": None, "seed": 1, "skew_probes": 0, "channels_last": True}
    runs = [
        run_experiment(make_config(None, {**base, "out": str(tmp_path / name), **extra})).records
        for name, extra in (("a", {}), ("b", {}), ("w", {"workers": 2}))
    ]
    strip = [[{k: v for k, v in r.items() if not k.startswith("time_")} for r in recs] for recs in runs]
    assert strip[0] == strip[1] == strip[2]


def test_cli_flag_sets_channels_last_and_the_config_records_it(tmp_path):
    import yaml

    from fedskew.cli import main

    out = tmp_path / "run"
    argv = ["run", "--clients", "3", "--rounds", "1", "--model", "lenet", "--channels-last", "--no-db", "--quiet"]
    assert main([*argv, "--out", str(out)]) == 0
    assert yaml.safe_load((out / "config.yaml").read_text())["channels_last"] is True
