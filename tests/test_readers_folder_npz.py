"""Your own data from the CLI: ``--dataset folder`` (PNG/JPEG class folders, cached) and ``--dataset npz`` (one pool,
or per-client files including PFLlib's dataset folder format), on tiny files written here in the real formats."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedskew.cli import main
from fedskew.config import ConfigError, make_config
from fedskew.data.federated import build_federated
from fedskew.data.readers import ClientDatasets, DataError, DatasetNotFoundError, clear_cache, load_dataset, load_source
from fedskew.data.readers import folder as folder_mod

PIL = pytest.importorskip("PIL.Image")


@pytest.fixture(autouse=True)
def _isolated(tmp_path_factory, monkeypatch):
    clear_cache()
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("FEDSKEW_DATA", raising=False)
    yield
    clear_cache()


def run_cli(out: Path, *args: str) -> list[dict]:
    """A short ``fedskew run`` (2 rounds, no database); returns its metrics.jsonl records."""
    code = main(["run", *args, "--rounds", "2", "--no-db", "--quiet", "--out", str(out)])
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ================================================================================================ folder


def save_image(path: Path, arr: np.ndarray, fmt: str = "PNG") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.fromarray(arr).save(path, format=fmt)


def write_folder(root: Path, classes=("cat", "dog", "eel"), per: int = 4, size: int = 8, seed: int = 0) -> dict:
    """Grayscale PNGs ``root/<class>/<i>.png``; returns {path: array}."""
    r = np.random.default_rng(seed)
    out = {}
    for c in classes:
        for i in range(per):
            a = r.integers(0, 256, (size, size), dtype=np.uint8)
            save_image(root / c / f"{i}.png", a)
            out[root / c / f"{i}.png"] = a
    return out


def test_folder_pool_labels_pixels_and_holdout(tmp_path):
    written = write_folder(tmp_path / "img")
    ds = load_dataset("folder", tmp_path / "img")
    assert ds.classes == ("cat", "dog", "eel") and ds.num_classes == 3
    assert ds.x_train.shape == (12, 1, 8, 8) and ds.x_train.dtype == np.uint8 and ds.x_test is None
    assert ds.y_train.tolist() == [0] * 4 + [1] * 4 + [2] * 4  # sorted class folders, files in sorted order
    assert np.array_equal(ds.x_train[5, 0], written[tmp_path / "img" / "dog" / "1.png"])  # PNG is lossless
    cfg = make_config(None, {"dataset": "folder", "data_dir": str(tmp_path / "img"), "clients": 2, "partition": "iid"})
    data = build_federated(cfg)  # no test split: a seeded stratified holdout (20%) is the global test set
    assert len(data.y_test) == 3 and sorted(data.y_test.tolist()) == [0, 1, 2]


def test_folder_train_test_split_colour_and_grey(tmp_path):
    root = tmp_path / "img"
    r = np.random.default_rng(1)
    grey = r.integers(0, 256, (10, 10), dtype=np.uint8)
    save_image(root / "train" / "a" / "0.png", grey)
    save_image(root / "train" / "a" / "1.jpg", r.integers(0, 256, (10, 10, 3), dtype=np.uint8), "JPEG")
    save_image(root / "train" / "b" / "0.png", r.integers(0, 256, (10, 10, 4), dtype=np.uint8))  # RGBA
    save_image(root / "val" / "b" / "9.jpeg", r.integers(0, 256, (10, 10, 3), dtype=np.uint8), "JPEG")
    ds = load_dataset("folder", root)
    assert ds.x_train.shape == (3, 3, 10, 10) and ds.x_test.shape == (1, 3, 10, 10)
    assert ds.y_train.tolist() == [0, 0, 1] and ds.y_test.tolist() == [1]
    assert np.array_equal(ds.x_train[0], np.stack([grey] * 3))  # grey replicated once any image is colour


def test_folder_16_bit_grey_is_scaled_and_float_images_refused(tmp_path):
    root = tmp_path / "img"
    write_folder(root, classes=("a", "b"), per=1, size=4)
    save_image(root / "b" / "wide.png", (np.arange(16).reshape(4, 4) * 4000).astype(np.uint16))  # 16-bit PNG
    ds = load_dataset("folder", root)
    assert ds.x_train.dtype == np.uint8 and ds.x_train[2, 0, 3, 3] == 233  # 60000 * 255 / 65535 = 233.4
    assert ds.x_train[2, 0, 0, 1] == 16  # 4000 * 255 / 65535 = 15.6
    PIL.fromarray(np.full((4, 4), 0.5, np.float32)).save(root / "a" / "f.tif")
    with pytest.raises(DataError, match=r"a/f.tif: floating-point image \(mode F\) has no fixed range"):
        load_dataset("folder", root)


def test_folder_cache_is_used_keyed_by_files_and_atomic(tmp_path, monkeypatch):
    root = tmp_path / "img"
    write_folder(root)
    first = load_dataset("folder", root)
    entries = list((root / folder_mod.CACHE_DIR).iterdir())
    assert len(entries) == 1 and entries[0].suffix == ".npz"  # one entry, no temporary file left
    clear_cache()

    def no_decode(path, resize):
        raise AssertionError(f"decoded {path} although the cache is current")

    monkeypatch.setattr(folder_mod, "_decode", no_decode)
    again = load_dataset("folder", root)  # from the cache: nothing decoded
    assert np.array_equal(again.x_train, first.x_train) and again.classes == first.classes
    st = (root / "cat" / "0.png").stat()
    os.utime(root / "cat" / "0.png", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: a new key
    with pytest.raises(AssertionError, match="decoded"):
        load_dataset("folder", root)
    monkeypatch.undo()
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path / "cache"))
    clear_cache()

    def crash(*args, **kwargs):  # the writer dies mid-file: nothing half-written may remain
        args[0].write(b"PK\x03\x04 partial")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", crash)
    load_dataset("folder", root)  # still decoded and returned; the cache is only skipped
    assert len(list((root / folder_mod.CACHE_DIR).iterdir())) == 1  # only the older, complete entry
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))


def test_folder_cache_falls_back_and_can_be_off(tmp_path, monkeypatch):
    root = tmp_path / "img"
    write_folder(root)
    real = folder_mod.write_cached

    def read_only_data_dir(path, ds):
        if root in path.parents:
            raise OSError("read-only file system")
        real(path, ds)

    monkeypatch.setattr(folder_mod, "write_cached", read_only_data_dir)
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path / "cache"))
    load_dataset("folder", root)
    assert len(list((tmp_path / "cache" / "folder").glob("folder-*.npz"))) == 1
    clear_cache()
    monkeypatch.setenv("FEDSKEW_CACHE", "off")
    write_folder(tmp_path / "other")
    load_dataset("folder", tmp_path / "other")
    assert not (tmp_path / "other" / folder_mod.CACHE_DIR).exists()


def test_folder_resize_makes_mixed_sizes_one_size(tmp_path):
    root = tmp_path / "img"
    write_folder(root, size=8)
    save_image(root / "dog" / "big.png", np.full((20, 14), 200, np.uint8))
    with pytest.raises(DataError, match=r"big.png: image is 14x20 but .*0.png is 8x8 .* --resize N"):
        load_dataset("folder", root)
    ds = load_dataset("folder", root, resize=12)
    assert ds.x_train.shape == (13, 1, 12, 12)
    assert np.all(ds.x_train[8] == 200)  # dog/big.png, after dog/0..3.png: a flat image stays flat


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda d: d.mkdir(), r"img: empty folder \(no class sub-folders\)"),
        (lambda d: save_image(d / "x.png", np.zeros((4, 4), np.uint8)), r"x.png, \.\.\.\) lie directly in the folder"),
        (lambda d: write_folder(d, classes=("only",)), r"found 1 class folder \('only'\); .* at least 2 classes"),
        (lambda d: (write_folder(d), (d / "fox").mkdir()), r"img/fox: class folder 'fox' holds no images"),
        (
            lambda d: (write_folder(d), (d / "dog" / "2.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")),
            r"img/dog/2.png: cannot decode image",
        ),
        (
            lambda d: (write_folder(d), save_image(d / "eel" / "9.png", np.zeros((8, 9), np.uint8))),
            r"eel/9.png: image is 9x8 but",
        ),
        (
            lambda d: (write_folder(d / "train"), write_folder(d / "test", classes=("cat", "yak"))),
            r"test: class folders \['yak'\] are not among the training classes",
        ),
    ],
    ids=["empty", "loose-images", "one-class", "empty-class", "undecodable", "mixed-sizes", "test-class"],
)
def test_folder_errors_name_the_problem(tmp_path, make, match):
    make(tmp_path / "img")
    with pytest.raises(DataError, match=match):
        load_dataset("folder", tmp_path / "img")


def test_folder_non_square_and_missing_dir(tmp_path):
    for c in ("a", "b"):
        save_image(tmp_path / "img" / c / "0.png", np.zeros((6, 9), np.uint8))
    with pytest.raises(DataError, match=r"0.png: images are 9x6 .* not square; .* --resize N"):
        load_dataset("folder", tmp_path / "img")
    assert load_dataset("folder", tmp_path / "img", resize=8).x_train.shape == (2, 1, 8, 8)
    with pytest.raises(DatasetNotFoundError, match="dataset 'folder' not found"):
        load_dataset("folder", tmp_path / "nowhere")
    with pytest.raises(DataError, match="takes only resize; got size"):
        load_dataset("folder", tmp_path / "img", size=3)


def test_folder_full_run(tmp_path):
    write_folder(tmp_path / "img", per=6)
    args = ["--dataset", "folder", "--data-dir", str(tmp_path / "img"), "--clients", "3", "--partition", "iid"]
    recs = run_cli(tmp_path / "run", *args)
    assert [r["round"] for r in recs] == [1, 2] and all(0 <= r["global_acc"] <= 1 for r in recs)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == "mlp" and summary["rounds"] == 2  # 8x8 images: auto picks the MLP
    assert "dataset: folder" in (tmp_path / "run" / "config.yaml").read_text()


# ================================================================================================ npz


def write_pfllib(root: Path, clients: int = 3, classes: int = 4, n: int = 12, seed: int = 0, channels: int = 1):
    """A PFLlib dataset folder exactly as dataset/utils/dataset_utils.py's save_file writes it: train/i.npz and
    test/i.npz each ``np.savez_compressed(f, data={'x': X, 'y': y})`` (X float32 normalised to [-1, 1] as its
    ``transforms.Normalize([0.5], [0.5])``, y int64), and config.json with the per-client label statistics."""
    r = np.random.default_rng(seed)
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    stats = []
    for k in range(clients):
        raw = r.integers(0, 256, (n, channels, 8, 8)).astype(np.float32) / 255.0
        x = ((raw - 0.5) / 0.5).astype(np.float32)
        y = r.integers(0, classes, n).astype(np.int64)
        cut = int(0.75 * n)
        for split, sl in (("train", slice(0, cut)), ("test", slice(cut, n))):
            with open(root / split / f"{k}.npz", "wb") as f:
                np.savez_compressed(f, data={"x": x[sl], "y": y[sl]})
        stats.append([(int(i), int(sum(y == i))) for i in np.unique(y)])
    config = {
        "num_clients": clients,
        "num_classes": classes,
        "non_iid": True,
        "balance": False,
        "partition": "dir",
        "Size of samples for labels in clients": stats,
        "alpha": 0.1,
        "batch_size": 10,
    }
    (root / "config.json").write_text(json.dumps(config))
    return config


def pfllib_read(path: Path) -> dict:
    """PFLlib's own reader (system/utils/data_utils.py read_data), as the reference."""
    with open(path, "rb") as f:
        return np.load(f, allow_pickle=True)["data"].tolist()


def test_pfllib_folder_is_the_federation_exactly(tmp_path):
    write_pfllib(tmp_path / "pf")
    src = load_source("npz", tmp_path / "pf")
    assert isinstance(src, ClientDatasets) and src.num_clients == 3 and src.num_classes == 4
    cfg = make_config(
        None,
        {"dataset": "npz", "data_dir": str(tmp_path / "pf"), "partition": "given", "protocol": "pfllib", "clients": 3},
    )
    data = build_federated(cfg)
    for k, c in enumerate(data.clients):
        tr, te = pfllib_read(tmp_path / "pf" / "train" / f"{k}.npz"), pfllib_read(tmp_path / "pf" / "test" / f"{k}.npz")
        assert torch.equal(c.x_train, torch.Tensor(tr["x"]).type(torch.float32))  # PFLlib's process_image
        assert torch.equal(c.y_train, torch.Tensor(tr["y"]).type(torch.int64))
        assert torch.equal(c.x_test, torch.Tensor(te["x"]).type(torch.float32))
        assert torch.equal(c.y_test, torch.Tensor(te["y"]).type(torch.int64))
    assert torch.equal(data.x_test, torch.cat([c.x_test for c in data.clients]))  # PFLlib: no separate test set
    assert (data.in_channels, data.image_size, data.num_classes) == (1, 8, 4)
    assert data.train_hists.sum() == 27 and data.test_hists.sum() == 9
    with pytest.raises(DataError, match="holds per-client files"):
        load_dataset("npz", tmp_path / "pf")


def test_pfllib_full_run_and_plain_per_client_files(tmp_path):
    write_pfllib(tmp_path / "pf")
    base = ["--dataset", "npz", "--data-dir", str(tmp_path / "pf"), "--partition", "given"]
    recs = run_cli(tmp_path / "run", *base, "--protocol", "pfllib", "--clients", "3")
    assert len(recs) == 2 and "global_acc" in recs[-1]
    # plain x/y arrays per client, no test/ folder: each client's data split with train_ratio, seeded
    d = tmp_path / "plain"
    (d / "train").mkdir(parents=True)
    r = np.random.default_rng(3)
    for k in range(2):
        np.savez(d / "train" / f"{k}.npz", x=r.integers(0, 256, (8, 1, 8, 8), dtype=np.uint8), y=np.arange(8) % 2)
    cfg = make_config(None, {"dataset": "npz", "data_dir": str(d), "partition": "given", "clients": 2})
    a, b = build_federated(cfg), build_federated(cfg)
    assert [(len(c.y_train), len(c.y_test)) for c in a.clients] == [(6, 2), (6, 2)]
    assert all(np.array_equal(x.train_index, y.train_index) for x, y in zip(a.clients, b.clients, strict=True))
    assert float(a.clients[0].x_train.min()) >= -1.0 and float(a.clients[0].x_train.max()) <= 1.0  # uint8 scaled


def test_npz_pool_layouts(tmp_path):
    r = np.random.default_rng(4)
    x, y = r.integers(0, 256, (30, 1, 8, 8), dtype=np.uint8), np.arange(30) % 3
    xt, yt = r.integers(0, 256, (9, 1, 8, 8), dtype=np.uint8), np.arange(9) % 3
    np.savez(tmp_path / "pool.npz", x=x, y=y, x_test=xt, y_test=yt)
    ds = load_dataset("npz", tmp_path / "pool.npz")
    assert np.array_equal(ds.x_train, x) and np.array_equal(ds.y_test, yt) and ds.num_classes == 3
    (tmp_path / "d").mkdir()
    np.savez(tmp_path / "d" / "mine.npz", x=x[:, 0].astype(np.int64), y=y.astype(np.float64), num_classes=5)
    ds = load_dataset("npz", tmp_path / "d")  # a folder with one .npz; [N, H, W] ints; integral float labels
    assert ds.x_train.shape == (30, 1, 8, 8) and ds.x_train.dtype == np.uint8 and ds.num_classes == 5
    assert ds.x_test is None and ds.y_train.dtype == np.int64
    np.savez(tmp_path / "feat.npz", x=r.normal(size=(40, 5)).astype(np.float32), y=np.arange(40) % 2)
    cfg = make_config(
        None, {"dataset": "npz", "data_dir": str(tmp_path / "feat.npz"), "clients": 2, "partition": "iid"}
    )
    data = build_federated(cfg)  # features: flattened for the MLP, used as they are
    assert (data.in_channels, data.image_size) == (5, 1)
    recs = run_cli(
        tmp_path / "run",
        "--dataset",
        "npz",
        "--data-dir",
        str(tmp_path / "pool.npz"),
        "--clients",
        "3",
        "--partition",
        "iid",
    )
    assert len(recs) == 2


def _pool(path: Path, **arrays) -> Path:
    r = np.random.default_rng(5)
    base = {"x": r.integers(0, 256, (6, 1, 4, 4), dtype=np.uint8), "y": np.array([0, 1, 0, 1, 0, 1])}
    np.savez(path, **{**base, **arrays})
    return path


class Evil:
    def __reduce__(self):
        return (os.system, ("echo owned",))


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({"y": np.array([0, 1, 0])}, r"pool.npz: y: 6 images but 3 labels"),
        ({"y": np.array([0, 1, 0.5, 1, 0, 1])}, r"pool.npz: y: non-integer labels \(1 of them, e.g. 0.5 at index 2\)"),
        ({"y": np.array([0, 1, -1, 1, 0, 1])}, r"pool.npz: y: labels out of range: -1"),
        (
            {"y": np.array([0, 1, 3, 1, 0, 1]), "num_classes": 3},
            r"pool.npz: y: labels out of range: 3 >= num_classes 3",
        ),
        ({"x": np.full((6, 1, 4, 4), np.nan, np.float32)}, r"pool.npz: x: 96 NaN/Inf values"),
        ({"x": np.array([0, 0, np.inf, 0, 0, 0], np.float32)[:, None, None, None] * np.ones((1, 1, 4, 4))}, r"Inf"),
        ({"x": np.arange(6)}, r"pool.npz: x: samples must be \[N, C, H, W\] images or \[N, F\] features"),
        ({"x": np.zeros((6, 8, 8, 3), np.uint8)}, r"looks channels-last"),
        ({"x": np.full((6, 1, 4, 4), 300)}, r"integer images must lie in 0..255"),
        ({"x_test": np.zeros((2, 1, 4, 4), np.uint8)}, r"x_test and y_test go together"),
        ({"x_test": np.zeros((2, 1, 5, 5), np.uint8), "y_test": np.array([0, 1])}, r"x_test: .* \(1, 5, 5\) but x"),
        ({"y": np.zeros(6, np.int64)}, r"every label is 0"),
    ],
    ids=[
        "length",
        "non-integer",
        "negative",
        "too-large",
        "nan",
        "inf",
        "dims",
        "channels-last",
        "range",
        "pair",
        "test-shape",
        "one-class",
    ],
)
def test_npz_pool_errors(tmp_path, arrays, match):
    _pool(tmp_path / "pool.npz", **arrays)
    with pytest.raises(DataError, match=match):
        load_dataset("npz", tmp_path / "pool.npz")


def _edit_client(path: Path, **changes) -> None:
    d = pfllib_read(path)
    d.update(changes)
    with open(path, "wb") as f:
        np.savez_compressed(f, data=d)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda d: (d / "train" / "2.npz").unlink(),
            r"train/2.npz: missing \(1 client files missing; config.json: num",
        ),
        (lambda d: (d / "test" / "1.npz").unlink(), r"test/1.npz: missing"),
        (lambda d: (d / "test").rename(d / "tst"), r"test: missing \(a PFLlib dataset folder has train/, test/"),
        (lambda d: np.savez(d / "train" / "3.npz", x=np.zeros((1, 1, 8, 8)), y=[0]), r"train/3.npz: beyond the 3"),
        (lambda d: (d / "train" / "a.npz").write_bytes(b""), r"train/a.npz: per-client files are named 0.npz"),
        (lambda d: _edit_client(d / "train" / "1.npz", y=np.zeros(5, np.int64)), r"train/1.npz: y: 9 images but 5"),
        (lambda d: _edit_client(d / "test" / "0.npz", y=np.full(3, 1.5)), r"test/0.npz: y: non-integer labels"),
        (lambda d: _edit_client(d / "train" / "0.npz", y=np.full(9, 4)), r"train/0.npz: y: labels out of range: 4 >="),
        (
            lambda d: _edit_client(d / "train" / "2.npz", x=np.full((9, 1, 8, 8), np.inf, np.float32)),
            r"2.npz: x: .*Inf",
        ),
        (
            lambda d: _edit_client(d / "train" / "1.npz", x=np.zeros((9, 3, 8, 8), np.float32)),
            r"1.npz: x: .* but .*0.npz",
        ),
        (lambda d: _edit_client(d / "train" / "0.npz", x=np.zeros(9, np.float32)), r"train/0.npz: x: samples must be"),
        (
            lambda d: _edit_client(d / "train" / "0.npz", y=np.zeros(9, np.int64)),
            r"config.json: 'Size of samples for labels in clients' of client 0 is .* but "
            r"train/0.npz \+ test/0.npz hold",
        ),
        (lambda d: (d / "config.json").write_text("{not json"), r"config.json: not a readable JSON file"),
        (lambda d: (d / "config.json").write_text('{"num_clients": 0}'), r"num_clients must be a positive integer"),
        (lambda d: (d / "train" / "1.npz").write_bytes(b"PK\x03\x04 truncated"), r"train/1.npz: not a readable .npz"),
        (lambda d: np.savez(d / "train" / "1.npz", z=np.zeros(2)), r"1.npz: holds \['z'\]; a client file needs"),
    ],
    ids=[
        "missing-train",
        "missing-test",
        "no-test-dir",
        "extra-client",
        "stray-name",
        "xy-length",
        "non-integer",
        "out-of-range",
        "inf",
        "shape-differs",
        "dims",
        "stats-mismatch",
        "bad-json",
        "bad-count",
        "corrupt",
        "keys",
    ],
)
def test_pfllib_folder_errors_name_file_and_problem(tmp_path, edit, match):
    write_pfllib(tmp_path / "pf")
    edit(tmp_path / "pf")
    with pytest.raises(DataError, match=match):
        load_source("npz", tmp_path / "pf")


def test_pfllib_pickle_is_restricted(tmp_path):
    write_pfllib(tmp_path / "pf")
    with open(tmp_path / "pf" / "train" / "1.npz", "wb") as f:  # a client file whose pickle would run a command
        np.savez(f, data=np.array({"x": Evil(), "y": [0]}, dtype=object))
    with pytest.raises(DataError, match=r"train/1.npz: cannot read PFLlib's pickled 'data' entry \(refusing to load"):
        load_source("npz", tmp_path / "pf")
    with open(tmp_path / "pf" / "train" / "1.npz", "wb") as f:
        np.savez(f, data=np.array([1, 2], dtype=object))
    with pytest.raises(DataError, match=r"entry 'data' must be PFLlib's pickled dict"):
        load_source("npz", tmp_path / "pf")


def test_npz_folder_layout_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no .npz file; expected one .npz with arrays x, y"):
        load_dataset("npz", tmp_path / "empty")
    (tmp_path / "two").mkdir()
    for name in ("a", "b"):
        _pool(tmp_path / "two" / f"{name}.npz")
    with pytest.raises(DataError, match=r"two: 2 .npz files \(a.npz, b.npz"):
        load_dataset("npz", tmp_path / "two")
    write_pfllib(tmp_path / "pf")
    with pytest.raises(DataError, match=r"0.npz: needs arrays x and y, holds \['data'\]; .* PFLlib's client files"):
        load_dataset("npz", tmp_path / "pf" / "train" / "0.npz")


def test_given_partition_config_and_build_checks(tmp_path):
    write_pfllib(tmp_path / "pf")
    _pool(tmp_path / "pool.npz")
    pf, pool = str(tmp_path / "pf"), str(tmp_path / "pool.npz")
    with pytest.raises(
        ConfigError,
        match=r"partition: given \(--partition given\), or natural to sample some of them, "
        r"instead of 'dir'",
    ):
        build_federated(make_config(None, {"dataset": "npz", "data_dir": pf, "clients": 3}))
    with pytest.raises(ConfigError, match=r"holds 3 clients but clients=10: set clients: 3"):
        build_federated(make_config(None, {"dataset": "npz", "data_dir": pf, "partition": "given"}))
    with pytest.raises(ConfigError, match=r"one pool of samples without a client assignment"):
        build_federated(make_config(None, {"dataset": "npz", "data_dir": pool, "partition": "given"}))
    refused = [
        ({"dataset": "npz"}, r"reads the folder given as data_dir"),
        ({"dataset": "folder"}, r"reads the folder given as data_dir"),
        ({"dataset": "mnist", "partition": "given"}, r"dataset 'mnist' has none"),
        ({"dataset": "npz", "data_dir": pf, "partition": "given", "imbalance_ratio": 10}, r"imbalance_ratio must"),
        ({"dataset": "npz", "data_dir": pf, "partition": "given", "protocol": "fedcac"}, r"not 'given'"),
        ({"dataset": "mnist", "resize": 16}, r"resize applies to image-folder datasets"),
    ]
    for values, match in refused:
        with pytest.raises(ConfigError, match=match):
            make_config(None, values)
    make_config(None, {"dataset": "npz", "data_dir": pf, "partition": "given", "protocol": "pfllib"})
    a = make_config(None, {"dataset": "folder", "data_dir": "/data/a", "partition": "iid"})
    b = make_config(None, {"dataset": "folder", "data_dir": "/data/b", "partition": "iid"})
    assert a.group_key() != b.group_key()  # the folder is the dataset: two folders, two experiments
    m = [make_config(None, {"dataset": "mnist", "data_dir": d}) for d in ("/x", "/y")]
    assert m[0].group_key() == m[1].group_key()  # official files: where they lie does not matter


def test_data_that_is_no_classification_task_is_refused_by_name(tmp_path):
    """Issue 46: one-class data trained and reported as a classification task, and labels {0, 1000000} built a
    million-way classifier that did not finish a round; both are refused when the dataset is read."""
    r = np.random.default_rng(0)
    x = r.integers(0, 256, (20, 1, 8, 8), dtype=np.uint8)
    np.savez(tmp_path / "one.npz", x=x, y=np.full(20, 3), num_classes=10)
    assert load_dataset("npz", tmp_path / "one.npz").num_classes == 10  # one node's own data may hold one class
    cfg = make_config(None, {"dataset": "npz", "data_dir": str(tmp_path / "one.npz"), "clients": 2, "partition": "iid"})
    with pytest.raises(DataError, match="holds only label 3; a classification task needs two classes or more"):
        build_federated(cfg)  # a whole dataset may not
    np.savez(tmp_path / "ids.npz", x=x, y=np.where(np.arange(20) % 2, 1_000_000, 0))
    with pytest.raises(DataError, match=r"1000001 classes for 20 training samples .* not ids"):
        load_dataset("npz", tmp_path / "ids.npz")
    np.savez(tmp_path / "ok.npz", x=x, y=np.arange(20) % 2 + 1)  # labels 1, 2: class 0 unused, still a task
    assert load_dataset("npz", tmp_path / "ok.npz").num_classes == 3


def test_an_empty_test_split_is_refused_rather_than_dropping_the_headline(tmp_path):
    """Whatever the reader (a user's, an image folder with an empty test/): the dataset itself refuses it."""
    from fedskew.data.readers import ImageDataset

    r = np.random.default_rng(0)
    x = r.integers(0, 256, (20, 1, 8, 8), dtype=np.uint8)
    with pytest.raises(DataError, match="its test split holds no samples"):
        ImageDataset("mine", x, np.arange(20) % 2, x[:0], np.arange(0), 2)
    np.savez(tmp_path / "e.npz", x=x, y=np.arange(20) % 2, x_test=x[:0], y_test=np.arange(0))
    with pytest.raises(DataError, match="x_test: no samples"):  # the npz reader says so first
        load_dataset("npz", tmp_path / "e.npz")
