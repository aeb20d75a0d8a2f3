"""Hugging Face datasets on disk (``--dataset hf``) and the flwr-datasets interop, on tiny datasets the tests write
with ``save_to_disk`` and as parquet (the ``[hf]`` extra)."""

from __future__ import annotations

import json

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("flwr_datasets")

from fedskew.cli import main  # noqa: E402
from fedskew.config import make_config  # noqa: E402
from fedskew.data.federated import build_federated  # noqa: E402
from fedskew.data.readers import load_source  # noqa: E402
from fedskew.data.readers.base import DataError  # noqa: E402

RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _hf_cache_in_tmp(tmp_path, monkeypatch):
    """datasets caches what it converts (parquet -> arrow) under HF_DATASETS_CACHE: inside the test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / ".hf-datasets")


def _images(n: int) -> list[np.ndarray]:
    return [RNG.integers(0, 256, size=(8, 8), dtype=np.uint8) for _ in range(n)]


def _image_dict(path, writers: int = 4, per: int = 10) -> str:
    feats = datasets.Features(
        {
            "image": datasets.Image(),
            "character": datasets.ClassLabel(names=[str(i) for i in range(10)]),
            "writer_id": datasets.Value("string"),
        }
    )

    def split(n_per: int, offset: int) -> datasets.Dataset:
        rows = {"image": [], "character": [], "writer_id": []}
        for w in range(writers):
            rows["image"] += _images(n_per)
            rows["character"] += [int(v) for v in RNG.integers(0, 10, size=n_per)]
            rows["writer_id"] += [f"w{w}"] * n_per
        return datasets.Dataset.from_dict(rows, features=feats)

    datasets.DatasetDict({"train": split(per, 0), "test": split(3, 1)}).save_to_disk(str(path))
    return str(path)


def test_save_to_disk_images_as_a_pool_and_as_natural_clients(tmp_path) -> None:
    d = _image_dict(tmp_path / "hfimg")
    pool = load_source("hf", d, label="character")
    assert pool.x_train.shape == (40, 1, 8, 8) and pool.x_train.dtype == np.uint8 and pool.y_test.shape == (12,)
    assert pool.num_classes == 10 and pool.classes[:2] == ("0", "1")
    clients = load_source("hf", d, label="character", partition_by="writer_id")
    assert clients.num_clients == 4 and clients.sources == ["w0", "w1", "w2", "w3"]
    assert [len(y) for y in clients.y_train] == [10] * 4 and [len(y) for y in clients.y_test] == [3] * 4
    cfg = {"dataset": "hf", "data_dir": d, "dataset_args": {"label": "character", "partition_by": "writer_id"}}
    data = build_federated(make_config({**cfg, "partition": "natural", "clients": 3, "db": None}))
    assert data.num_clients == 3
    tr = np.concatenate([c.train_index for c in data.clients])
    assert not set(tr) & set(np.concatenate([c.test_index for c in data.clients]))


def test_fedskew_run_on_a_saved_dataset(tmp_path, capsys) -> None:
    d = _image_dict(tmp_path / "hfimg")
    base = ["run", "--dataset", "hf", "--data-dir", d, "-D", "label=character", "--rounds", "1", "--local-epochs", "1"]
    argv = [*base, "-D", "partition_by=writer_id", "--partition", "natural", "--clients", "4", "--model", "mlp"]
    assert main([*argv, "--out", str(tmp_path / "a"), "--no-db"]) == 0, capsys.readouterr().err
    assert main([*base, "--partition", "dir", "--clients", "3", "--out", str(tmp_path / "b"), "--no-db"]) == 0
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["rounds"] == 1
    assert main([*base, "-D", "nope=1", "--out", str(tmp_path / "c"), "--no-db"]) == 2
    assert "does not take option(s) ['nope']" in capsys.readouterr().err


def test_parquet_tabular_and_text_columns(tmp_path) -> None:
    n = 30
    table = datasets.Dataset.from_dict(
        {"f1": RNG.random(n).tolist(), "f2": RNG.random(n).tolist(), "kind": [["cat", "dog"][i % 2] for i in range(n)]}
    )
    table.to_parquet(str(tmp_path / "train.parquet"))
    tab = load_source("hf", str(tmp_path / "train.parquet"), label="kind")
    assert tab.x_train.shape == (n, 2) and tab.x_train.dtype == np.float32 and tab.classes == ("cat", "dog")
    assert tab.x_test is None and tab.y_train.tolist()[:2] == [0, 1]
    text = datasets.Dataset.from_dict(
        {
            "text": [f"good movie {i % 3}" if i % 2 else f"bad film {i % 3}" for i in range(n)],
            "label": [i % 2 for i in range(n)],
        }
    )
    text.save_to_disk(str(tmp_path / "txt"))
    tok = load_source("hf", str(tmp_path / "txt"), seq_len=6)
    assert tok.x_train.dtype == np.int64 and tok.x_train.shape == (n, 6) and "good" in tok.vocabulary


def test_bad_columns_and_splits_are_named(tmp_path) -> None:
    d = _image_dict(tmp_path / "hfimg")
    with pytest.raises(DataError, match=r"no label column 'label'.*columns: \['character', 'image', 'writer_id'\]"):
        load_source("hf", d)
    with pytest.raises(DataError, match="no column 'author' for -D partition_by"):
        load_source("hf", d, label="character", partition_by="author")
    with pytest.raises(DataError, match="no split 'training'"):
        load_source("hf", d, label="character", train_split="training")
    with pytest.raises(DataError, match="not a save_to_disk folder or parquet files"):
        load_source("hf", str(tmp_path))


def test_fedskew_partitioner_round_trip_gives_fedskews_clients(tmp_path) -> None:
    """A fedskew partition through flwr-datasets: FedskewPartitioner over the training split holds, per client, exactly
    the samples fedskew's run gives that client (its train and local test splits together)."""
    from flwr_datasets import FederatedDataset  # noqa: F401 - the class Flower users hand it to

    from fedskew.data.flwr_interop import FedskewPartitioner

    x = RNG.integers(0, 256, size=(400, 1, 8, 8), dtype=np.uint8)
    y = RNG.integers(0, 10, size=400)
    xt, yt = RNG.integers(0, 256, size=(50, 1, 8, 8), dtype=np.uint8), RNG.integers(0, 10, size=50)
    np.savez(tmp_path / "pool.npz", x=x, y=y, x_test=xt, y_test=yt)
    cfg = make_config(
        {"dataset": "npz", "data_dir": str(tmp_path / "pool.npz"), "partition": "dir", "alpha": 0.3, "clients": 5}
        | {"seed": 7, "db": None}
    )
    data = build_federated(cfg)
    part = FedskewPartitioner("dir", 5, seed=7, alpha=0.3, min_size=10)
    part.dataset = datasets.Dataset.from_dict({"label": y.tolist(), "row": list(range(400))})
    for c in data.clients:
        ours = np.sort(np.concatenate([c.train_index, c.test_index]))
        np.testing.assert_array_equal(np.asarray(part.load_partition(c.cid)["row"]), ours)
    assert part.num_partitions == 5


def test_a_flwr_partitioner_as_a_fedskew_partition(tmp_path, capsys) -> None:
    from fedskew.data.partition import make_partition

    y = np.repeat(np.arange(10), 40)
    parts = make_partition(
        "flwr", y, 5, np.random.default_rng(0), partitioner="DirichletPartitioner", alpha=0.5, min_partition_size=5
    )
    assert sorted(np.concatenate(parts).tolist()) == list(range(400))  # disjoint and complete
    again = make_partition(
        "flwr", y, 5, np.random.default_rng(0), partitioner="DirichletPartitioner", alpha=0.5, min_partition_size=5
    )
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))  # seeded by fedskew's stream
    argv = ["run", "--partition", "flwr", "-P", "partitioner=PathologicalPartitioner"]
    argv += ["-P", "num_classes_per_partition=2", "--clients", "5", "--rounds", "1", "--local-epochs", "1"]
    assert main([*argv, "--out", str(tmp_path / "r"), "--no-db"]) == 0, capsys.readouterr().err
    bad = ["run", "--partition", "flwr", "-P", "partitioner=NoSuchPartitioner", "--out", str(tmp_path / "x"), "--no-db"]
    assert main(bad) == 2
    assert "no partitioner 'NoSuchPartitioner'" in capsys.readouterr().err


def test_a_flower_federation_loads_its_node_data_through_datasets(tmp_path) -> None:
    """`fedskew flower new` writes the reader's options as a table of the app's run config, and the in-process
    Flower federation's nodes draw their natural clients from the saved dataset with the simulator's numbers."""
    pytest.importorskip("flwr")
    from fedskew.flower.inprocess import make_grid, run_in_process
    from fedskew.flower.settings import parse_run_config, run_config

    d = _image_dict(tmp_path / "hfimg", writers=3)
    values = {
        "dataset": "hf",
        "data_dir": d,
        "dataset_args": {"label": "character", "partition_by": "writer_id"},
        "partition": "natural",
        "clients": 3,
        "rounds": 2,
        "local_epochs": 1,
        "model": "mlp",
        "skew_probes": 0,
    }
    cfg = make_config(values, {"out": str(tmp_path / "fl"), "db": None})
    flat = run_config(cfg)
    assert flat["dataset_args.partition_by"] == "writer_id" and parse_run_config(flat)[0] == cfg
    run_in_process(cfg, grid=make_grid(cfg))
    sim = tmp_path / "sim"
    assert (
        main(
            [
                "run",
                "--no-db",
                "--quiet",
                "--out",
                str(sim),
                *sum((["--" + k.replace("_", "-"), str(v)] for k, v in values.items() if k != "dataset_args"), []),
                "-D",
                "label=character",
                "-D",
                "partition_by=writer_id",
            ]
        )
        == 0
    )
    fl = [json.loads(x)["global_acc"] for x in (tmp_path / "fl" / "metrics.jsonl").read_text().splitlines()]
    si = [json.loads(x)["global_acc"] for x in (sim / "metrics.jsonl").read_text().splitlines()]
    assert fl == pytest.approx(si, abs=1e-6)


def test_hf_name_reads_the_local_cache_offline(tmp_path, monkeypatch) -> None:
    """`--dataset hf:NAME` is `--dataset hf -D hub=NAME`: read from the local Hugging Face cache with the network off;
    a dataset not in it is a one-line error, never a download."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = make_config({"dataset": "hf:someone/not-cached", "dataset_args": {"label": "y"}, "db": None})
    assert cfg.dataset == "hf" and cfg.dataset_args == {"label": "y", "hub": "someone/not-cached"}
    with pytest.raises(DataError, match="'someone/not-cached' is not in the local Hugging Face cache"):
        build_federated(cfg)
