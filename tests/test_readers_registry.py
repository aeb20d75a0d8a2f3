"""The dataset registry: a format is one reader function registered under a name with its metadata, from fedskew,
from user code or from an installed package's ``fedskew.datasets`` entry point."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedskew.cli import main
from fedskew.config import make_config
from fedskew.data.readers import (
    DATASETS,
    DataError,
    DatasetSpec,
    ImageDataset,
    clear_cache,
    dataset_names,
    get_spec,
    load_dataset,
    register_reader,
    registry,
    unregister_reader,
)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path_factory):
    clear_cache()
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    for name in ("toy", "plugged"):
        if name in registry._SPECS:
            unregister_reader(name)
    clear_cache()


def load_toy(d: Path) -> ImageDataset:
    """A whole format in a few lines: ``toy.csv`` rows ``label,f1,f2,f3,f4`` as float features ``[N, 4]``."""
    rows = np.loadtxt(d / "toy.csv", delimiter=",", ndmin=2)
    return ImageDataset("toy", rows[:, 1:].astype(np.float32), rows[:, 0].astype(np.int64), None, None, 2)


TOY = DatasetSpec(
    "toy",
    load_toy,
    summary="toy CSV features",
    probe=lambda d: (d / "toy.csv").is_file(),
    expected="toy.csv",
    needs_data_dir=True,
    aliases=("toy-csv",),
)


def write_toy(d: Path, n: int = 40) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    r = np.random.default_rng(0)
    y = np.arange(n) % 2
    x = r.normal(size=(n, 4)) + y[:, None]
    np.savetxt(d / "toy.csv", np.column_stack([y, x]), delimiter=",")
    return d


def test_builtin_names_and_metadata():
    assert DATASETS[:3] == ("digits", "mnist", "fmnist") and {"folder", "npz"} <= set(DATASETS)
    assert get_spec("Fashion-MNIST").name == "fmnist" and get_spec("cifar-10").name == "cifar10"
    assert get_spec("npz").per_client and get_spec("folder").options == ("resize",)
    assert registry.ORIGIN["mnist"] == "fedskew"
    with pytest.raises(DataError, match="dataset 'digits' takes no options; got resize"):
        load_dataset("digits", resize=3)


def test_user_format_is_one_registration_and_runs(tmp_path):
    register_reader(TOY)
    assert "toy" in dataset_names() and registry.ORIGIN["toy"] == "user code"
    ds = load_dataset("toy-csv", write_toy(tmp_path / "data"))
    assert ds.x_train.shape == (40, 4) and ds.x_train.dtype == np.float32
    with pytest.raises(DataError, match="dataset 'toy' reads the folder given as data_dir"):
        load_dataset("toy")
    a = make_config(None, {"dataset": "toy", "data_dir": "/a"})
    assert a.group_key() != make_config(None, {"dataset": "toy", "data_dir": "/b"}).group_key()
    out = tmp_path / "run"
    args = ["run", "--dataset", "toy", "--data-dir", str(tmp_path / "data"), "--clients", "2", "--partition", "iid"]
    assert main([*args, "--rounds", "2", "--no-db", "--quiet", "--out", str(out)]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert json.loads((out / "summary.json").read_text())["model"] == "mlp"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (DatasetSpec("mnist", load_toy), r"dataset name 'mnist' is taken by 'mnist' \(fedskew\)"),
        (DatasetSpec("toy", load_toy, aliases=("fashion-mnist",)), r"'fashion-mnist' is taken by 'fmnist'"),
        (DatasetSpec("Bad Name", load_toy), r"dataset name 'Bad Name' must be lower-case"),
        (DatasetSpec("toy", "not callable"), r"dataset 'toy': loader must be callable"),  # type: ignore[arg-type]
        (DatasetSpec("toy", load_toy, options=("not-an-identifier",)), r"options \['not-an-identifier'\]"),
    ],
    ids=["taken", "alias-taken", "bad-name", "loader", "option"],
)
def test_registration_refused(spec, match):
    with pytest.raises(DataError, match=match):
        register_reader(spec)
    assert "toy" not in registry._SPECS


def test_unregister(tmp_path):
    with pytest.raises(DataError, match="'mnist' is a built-in dataset"):
        unregister_reader("mnist")
    register_reader(TOY)
    load_dataset("toy", write_toy(tmp_path / "data"))
    unregister_reader("toy")
    with pytest.raises(DataError, match="unknown dataset 'toy-csv'"):
        load_dataset("toy-csv", tmp_path / "data")


class FakeEntryPoint:
    def __init__(self, name: str, value: str, obj: object) -> None:
        self.name, self.value, self._obj = name, value, obj

    def load(self) -> object:
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


def _entry_points(monkeypatch, *eps: FakeEntryPoint) -> None:
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.setattr(
        registry.metadata, "entry_points", lambda group: list(eps) if group == registry.ENTRY_POINT_GROUP else []
    )


def test_entry_point_plugin_is_found_on_first_unknown_name(monkeypatch, tmp_path):
    plugged = DatasetSpec("plugged", load_toy, probe=lambda d: (d / "toy.csv").is_file(), needs_data_dir=True)
    _entry_points(monkeypatch, FakeEntryPoint("plugged", "toy_pkg:specs", lambda: [plugged]))
    ds = load_dataset("plugged", write_toy(tmp_path / "data"))  # not registered yet: the entry points are read
    assert ds.x_train.shape == (40, 4) and registry.ORIGIN["plugged"] == "entry point toy_pkg:specs"
    assert "plugged" in dataset_names()
    make_config(None, {"dataset": "plugged", "data_dir": str(tmp_path / "data")})  # validated like a built-in


def test_broken_entry_point_says_so(monkeypatch):
    _entry_points(monkeypatch, FakeEntryPoint("bad", "bad_pkg:specs", ImportError("No module named 'bad_pkg'")))
    with pytest.raises(DataError, match=r"entry point 'bad' \(bad_pkg:specs\) failed to load: No module named"):
        load_dataset("nothing-here")
