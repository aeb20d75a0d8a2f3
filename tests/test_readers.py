"""Readers of the official dataset formats, on tiny files written here in the real formats, plus integration
checks against the offline copies in ../shared/data when they are present."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from fedskew.data import readers
from fedskew.data.readers import (
    DATASETS,
    DataError,
    DatasetNotFoundError,
    ImageDataset,
    clear_cache,
    digits_domains,
    load_dataset,
    load_domain_folders,
    read_idx,
    read_libsvm,
)

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(autouse=True)
def _isolated(tmp_path_factory, monkeypatch):
    """No in-process cache carried between tests; on-disk cache and FEDSKEW_DATA confined to temp dirs."""
    clear_cache()
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path_factory.mktemp("npz-cache")))
    monkeypatch.delenv("FEDSKEW_DATA", raising=False)
    yield
    clear_cache()


# ------------------------------------------------------------------------------------------ format writers


def idx_bytes(arr: np.ndarray, code: int = 0x08) -> bytes:
    dtype = {0x08: np.uint8, 0x0C: np.dtype(">i4")}[code]
    head = struct.pack(">BBBB", 0, 0, code, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return head + np.asarray(arr).astype(dtype).tobytes()


def write_mnist(d: Path, n_train: int = 12, n_test: int = 5, seed: int = 0, gz: bool = True) -> dict[str, np.ndarray]:
    d.mkdir(parents=True, exist_ok=True)
    r = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": r.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": r.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": r.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": r.integers(0, 10, n_test, dtype=np.uint8),
    }
    for name, arr in arrays.items():
        raw = idx_bytes(arr)
        (d / (name + ".gz" if gz else name)).write_bytes(gzip.compress(raw) if gz else raw)
    return arrays


def libsvm_text(x: np.ndarray, y: np.ndarray) -> bytes:
    lines = []
    for row, label in zip(x, y, strict=True):
        lines.append(f"{label} " + " ".join(f"{i + 1}:{v:.6f}" for i, v in enumerate(row) if v != 0.0))
    return ("\n".join(lines) + "\n").encode()


def write_usps_libsvm(d: Path, n_train: int = 9, n_test: int = 4, which: str = "both") -> None:
    d.mkdir(parents=True, exist_ok=True)
    r = np.random.default_rng(1)
    for name, n in (("usps.bz2", n_train), ("usps.t.bz2", n_test)):
        if which == "both" or which == name:
            x = r.choice([-1.0, -0.5, 0.0, 0.5, 1.0], size=(n, 256))
            (d / name).write_bytes(bz2.compress(libsvm_text(x, r.integers(1, 11, n))))


def write_png(path: Path, arr: np.ndarray) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path, format="PNG")


# ------------------------------------------------------------------------------------------ IDX


def test_read_idx_gzip_and_plain(tmp_path):
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "a.gz").write_bytes(gzip.compress(idx_bytes(a)))
    (tmp_path / "a").write_bytes(idx_bytes(a))
    b = np.array([[-5, 70000], [3, 1]], dtype=np.int32)
    (tmp_path / "b").write_bytes(idx_bytes(b, code=0x0C))
    assert np.array_equal(read_idx(tmp_path / "a.gz"), a)
    assert np.array_equal(read_idx(str(tmp_path / "a")), a)
    out = read_idx(tmp_path / "b")
    assert out.dtype == np.int32 and np.array_equal(out, b)
    out[0, 0] = 1  # writable copy


def test_read_idx_truncated_gzip(tmp_path):
    raw = gzip.compress(idx_bytes(np.random.default_rng(0).integers(0, 256, (50, 28, 28), dtype=np.uint8)))
    p = tmp_path / "train-images-idx3-ubyte.gz"
    p.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz.*(truncated|corrupt)"):
        read_idx(p)


def test_read_idx_truncated_payload_and_trailing(tmp_path):
    raw = idx_bytes(np.zeros((4, 28, 28), dtype=np.uint8))
    p = tmp_path / "short.gz"
    p.write_bytes(gzip.compress(raw[:-10]))
    with pytest.raises(DataError, match="short.gz: IDX data truncated"):
        read_idx(p)
    p.write_bytes(gzip.compress(raw + b"xx"))
    with pytest.raises(DataError, match="trailing bytes"):
        read_idx(p)
    p.write_bytes(gzip.compress(raw[:10]))
    with pytest.raises(DataError, match="truncated IDX header"):
        read_idx(p)


def test_read_idx_bad_magic(tmp_path):
    p = tmp_path / "bad"
    p.write_bytes(b"\x12\x34\x08\x01" + struct.pack(">I", 3) + b"abc")
    with pytest.raises(DataError, match="bad: bad IDX magic number 0x12340801"):
        read_idx(p)
    p.write_bytes(b"\x00\x00\x07\x01" + struct.pack(">I", 3) + b"abc")
    with pytest.raises(DataError, match="unknown data type code 0x07"):
        read_idx(p)
    with pytest.raises(DataError, match="file not found"):
        read_idx(tmp_path / "missing.gz")


def test_mnist_rejects_wrong_magic_and_count_mismatch(tmp_path):
    arrays = write_mnist(tmp_path / "mnist")
    images = tmp_path / "mnist" / "train-images-idx3-ubyte.gz"
    images.write_bytes(gzip.compress(idx_bytes(arrays["train-labels-idx1-ubyte"])))  # labels where images belong
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz: expected IDX magic 2051"):
        load_dataset("mnist", tmp_path)
    images.write_bytes(gzip.compress(idx_bytes(arrays["train-images-idx3-ubyte"][:-1])))
    with pytest.raises(DataError, match="11 images but .* 12 labels"):
        load_dataset("mnist", tmp_path)


# ------------------------------------------------------------------------------------------ resolution


def test_mnist_layouts_and_cache(tmp_path, monkeypatch):
    arrays = write_mnist(tmp_path / "root" / "mnist")
    for where in (tmp_path / "root", tmp_path / "root" / "mnist", str(tmp_path / "root")):
        ds = load_dataset("mnist", where)
        assert ds.x_train.shape == (12, 1, 28, 28) and ds.x_train.dtype == np.uint8
        assert ds.y_train.dtype == np.int64 and ds.num_classes == 10
        assert np.array_equal(ds.x_train[:, 0], arrays["train-images-idx3-ubyte"])
        assert np.array_equal(ds.y_test, arrays["t10k-labels-idx1-ubyte"])
    assert load_dataset("mnist", tmp_path / "root") is load_dataset("mnist", tmp_path / "root" / "mnist")
    monkeypatch.setenv("FEDSKEW_DATA", str(tmp_path / "elsewhere") + ":" + str(tmp_path / "root"))
    assert load_dataset("MNIST").x_test is not None  # env var, second of two directories, case-insensitive


def test_fmnist_folder_names_and_plain_idx(tmp_path):
    write_mnist(tmp_path / "a" / "fashion-mnist", seed=1)
    write_mnist(tmp_path / "b" / "fmnist", seed=2, gz=False)
    write_mnist(tmp_path / "c" / "mnist", seed=3)
    assert load_dataset("fmnist", tmp_path / "a").name == "fmnist"
    assert load_dataset("fashion-mnist", tmp_path / "b").x_train.shape == (12, 1, 28, 28)
    with pytest.raises(DatasetNotFoundError):  # an "mnist" folder is never taken for Fashion-MNIST
        load_dataset("fmnist", tmp_path / "c" / "mnist")


def test_idx_images_of_zero_size_are_refused_by_name(tmp_path):
    d = tmp_path / "mnist"
    write_mnist(d)
    (d / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(np.zeros((12, 0, 0), np.uint8))))
    with pytest.raises(DataError, match=r"mnist: its samples hold no values \(each is \[1, 0, 0\]\)"):
        load_dataset("mnist", tmp_path)


def test_not_found_names_dirs_and_files(tmp_path):
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset("mnist", tmp_path)
    msg = str(err.value)
    assert "'mnist' not found" in msg and str(tmp_path) in msg and str(tmp_path / "mnist") in msg
    assert "train-images-idx3-ubyte.gz" in msg and "t10k-labels-idx1-ubyte.gz" in msg
    with pytest.raises(DataError, match="unknown dataset 'imagenet'"):
        load_dataset("imagenet", tmp_path)


def test_missing_one_file(tmp_path):
    write_mnist(tmp_path / "mnist")
    (tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="missing t10k-labels-idx1-ubyte.gz"):
        load_dataset("mnist", tmp_path)


def test_dataset_names():
    assert set(DATASETS) >= {
        "digits",
        "mnist",
        "fmnist",
        "usps",
        "cifar10",
        "cifar100",
        "svhn",
        "tinyimagenet",
        "cinic10",
        "office_caltech",
    }


# ------------------------------------------------------------------------------------------ digits


def test_digits_rescaled():
    from sklearn.datasets import load_digits

    ds = load_dataset("digits")
    assert ds.x_train.shape == (1797, 1, 8, 8) and ds.x_train.dtype == np.uint8
    assert ds.x_test is None and ds.y_test is None and ds.num_classes == 10
    raw = load_digits().images
    assert np.array_equal(ds.x_train[:, 0], np.rint(raw * 255 / 16).astype(np.uint8))
    assert ds.x_train.max() == 255 and ds.x_train.min() == 0


# ------------------------------------------------------------------------------------------ USPS


def test_usps_libsvm_pair(tmp_path):
    d = tmp_path / "usps"
    d.mkdir()
    x = np.zeros((3, 256))
    x[0, :] = -1.0
    x[1, :] = 1.0
    x[2, 10] = 0.5  # sparse line: absent features are 0 -> mid-grey
    (d / "usps.bz2").write_bytes(bz2.compress(libsvm_text(x, np.array([1, 10, 5]))))
    (d / "usps.t.bz2").write_bytes(bz2.compress(libsvm_text(x[:2], np.array([2, 3]))))
    ds = load_dataset("usps", tmp_path)
    assert ds.x_train.shape == (3, 1, 16, 16) and ds.x_test.shape == (2, 1, 16, 16)
    assert np.array_equal(ds.y_train, [0, 9, 4]) and np.array_equal(ds.y_test, [1, 2])
    assert ds.x_train[0].max() == 0 and ds.x_train[1].min() == 255
    assert ds.x_train[2, 0, 0, 10] == 191 and ds.x_train[2, 0, 0, 0] == 128


def test_usps_needs_both_splits(tmp_path):
    write_usps_libsvm(tmp_path / "usps", which="usps.t.bz2")
    with pytest.raises(DataError, match="usps.bz2"):
        load_dataset("usps", tmp_path)


def test_libsvm_malformed(tmp_path):
    p = tmp_path / "bad.t"
    p.write_bytes(b"1 1:0.5 2:0.1\n3 1:abc\n")
    with pytest.raises(DataError, match="bad.t, line 2: malformed"):
        read_libsvm(p)
    p.write_bytes(b"1 300:0.5\n")
    with pytest.raises(DataError, match="feature indices"):
        read_libsvm(p)
    p.write_bytes(bz2.compress(b"1 1:0.5\n" * 100)[:40])
    with pytest.raises(DataError, match="corrupt or truncated"):
        read_libsvm(p)


def test_usps_h5(tmp_path):
    h5py = pytest.importorskip("h5py")
    d = tmp_path / "usps"
    d.mkdir()
    r = np.random.default_rng(2)
    with h5py.File(d / "usps.h5", "w") as f:
        for split, n in (("train", 7), ("test", 3)):
            g = f.create_group(split)
            g.create_dataset("data", data=r.random((n, 256)).astype(np.float32))
            g.create_dataset("target", data=r.integers(0, 10, n).astype(np.int32))
        expected = np.rint(f["train"]["data"][()].astype(np.float64) * 255).astype(np.uint8)
    write_usps_libsvm(d, which="usps.t.bz2")  # an incomplete LIBSVM pair: h5 wins
    ds = load_dataset("usps", tmp_path)
    assert ds.x_train.shape == (7, 1, 16, 16) and ds.x_test.shape == (3, 1, 16, 16)
    assert np.array_equal(ds.x_train.reshape(7, 256), expected)
    (d / "usps.h5").write_bytes(b"not an hdf5 file at all")
    clear_cache()
    with pytest.raises(DataError, match="usps.h5"):
        load_dataset("usps", tmp_path)


# ------------------------------------------------------------------------------------------ CIFAR / SVHN


def write_cifar_batch(path: Path, n: int, key: str, classes: int, seed: int) -> tuple[np.ndarray, list[int]]:
    r = np.random.default_rng(seed)
    data = r.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = r.integers(0, classes, n).tolist()
    with path.open("wb") as f:  # python-2 style: bytes keys, protocol 2
        pickle.dump({b"batch_label": b"x", b"data": data, key.encode(): labels}, f, protocol=2)
    return data, labels


def test_cifar10_batches(tmp_path):
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    parts = [write_cifar_batch(d / f"data_batch_{i}", 3, "labels", 10, i) for i in range(1, 6)]
    test_data, test_labels = write_cifar_batch(d / "test_batch", 4, "labels", 10, 9)
    ds = load_dataset("cifar10", tmp_path)
    assert ds.x_train.shape == (15, 3, 32, 32) and ds.x_test.shape == (4, 3, 32, 32) and ds.num_classes == 10
    assert np.array_equal(ds.x_train[0, 1].ravel(), parts[0][0][0, 1024:2048])  # channel-major rows
    assert ds.y_train.tolist() == sum((p[1] for p in parts), [])
    assert ds.y_test.tolist() == test_labels


def test_cifar100_fine_labels_and_unsafe_pickle(tmp_path):
    d = tmp_path / "cifar-100-python"
    d.mkdir()
    _, labels = write_cifar_batch(d / "train", 6, "fine_labels", 100, 1)
    write_cifar_batch(d / "test", 2, "fine_labels", 100, 2)
    ds = load_dataset("cifar100", tmp_path)
    assert ds.num_classes == 100 and ds.y_train.tolist() == labels
    clear_cache()

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    (d / "test").write_bytes(pickle.dumps({"data": Evil()}))
    with pytest.raises(DataError, match="refusing to load builtins.print"):
        load_dataset("cifar100", tmp_path)


def test_svhn_mat(tmp_path):
    import scipy.io

    d = tmp_path / "svhn"
    d.mkdir()
    r = np.random.default_rng(3)
    x = r.integers(0, 256, (32, 32, 3, 5), dtype=np.uint8)
    y = np.array([[10], [1], [2], [10], [9]], dtype=np.uint8)
    scipy.io.savemat(d / "train_32x32.mat", {"X": x, "y": y})
    scipy.io.savemat(d / "test_32x32.mat", {"X": x[..., :2], "y": y[:2]})
    ds = load_dataset("svhn", tmp_path)
    assert ds.x_train.shape == (5, 3, 32, 32) and ds.y_train.tolist() == [0, 1, 2, 0, 9]
    assert np.array_equal(ds.x_train[3, 2], x[:, :, 2, 3])
    (d / "test_32x32.mat").write_bytes(b"MATLAB 5.0 junk")
    clear_cache()
    with pytest.raises(DataError, match="test_32x32.mat"):
        load_dataset("svhn", tmp_path)


# ------------------------------------------------------------------------------------------ image folders


def test_cinic10_folders_and_disk_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("FEDSKEW_CACHE", str(cache))
    root = tmp_path / "cinic10"
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    r = np.random.default_rng(4)
    for split, per in (("train", 2), ("valid", 1), ("test", 1)):
        for c in classes:
            for i in range(per):
                write_png(root / split / c / f"{c}_{i}.png", r.integers(0, 256, (32, 32, 3), dtype=np.uint8))
    gray = r.integers(0, 256, (32, 32), dtype=np.uint8)
    write_png(root / "test" / "truck" / "gray.png", gray)  # grayscale image -> replicated to RGB
    ds = load_dataset("cinic10", tmp_path)
    assert ds.x_train.shape == (20, 3, 32, 32) and ds.x_test.shape == (11, 3, 32, 32)
    assert ds.y_train.tolist() == [i for i in range(10) for _ in range(2)]
    assert np.array_equal(ds.x_test[-2], np.stack([gray] * 3))
    assert len(list(cache.glob("cinic10-*.npz"))) == 1
    clear_cache()
    again = load_dataset("cinic10", tmp_path)  # from the .npz cache
    assert np.array_equal(again.x_train, ds.x_train) and np.array_equal(again.y_test, ds.y_test)


def test_tinyimagenet_layout(tmp_path):
    root = tmp_path / "tiny-imagenet-200"
    r = np.random.default_rng(5)
    wnids = ["n02", "n01"]
    (root).mkdir()
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for w in wnids:
        for i in range(2):
            write_png(root / "train" / w / "images" / f"{w}_{i}.JPEG", r.integers(0, 256, (64, 64, 3), np.uint8))
    ann = []
    for i, w in enumerate(["n02", "n01", "n02"]):
        write_png(root / "val" / "images" / f"val_{i}.JPEG", r.integers(0, 256, (64, 64, 3), np.uint8))
        ann.append(f"val_{i}.JPEG\t{w}\t0\t0\t10\t10")
    (root / "val" / "val_annotations.txt").write_text("\n".join(ann) + "\n")
    ds = load_dataset("tinyimagenet", tmp_path)
    assert ds.num_classes == 2 and ds.x_train.shape == (4, 3, 64, 64)
    assert ds.y_train.tolist() == [0, 0, 1, 1]  # classes = sorted wnids: n01 -> 0
    assert ds.y_test.tolist() == [1, 0, 1]


def test_office_domains(tmp_path):
    root = tmp_path / "office_caltech_10"
    r = np.random.default_rng(6)
    for dom, hw in (("amazon", (30, 40)), ("dslr", (50, 20))):
        for c in ("back_pack", "mug") if dom == "amazon" else ("mug", "bike"):
            for i in range(2):
                write_png(root / dom / c / f"{i}.png", r.integers(0, 256, (*hw, 3), dtype=np.uint8))
    doms = load_domain_folders(root, 16)
    assert list(doms) == ["amazon", "dslr"]
    assert doms["amazon"].x_train.shape == (4, 3, 16, 16) and doms["amazon"].x_test is None
    assert doms["amazon"].num_classes == doms["dslr"].num_classes == 3  # union: back_pack, bike, mug
    assert doms["amazon"].y_train.tolist() == [0, 0, 2, 2] and doms["dslr"].y_train.tolist() == [1, 1, 2, 2]
    pooled = load_dataset("office_caltech", tmp_path)
    assert pooled.x_train.shape == (8, 3, readers.OFFICE_POOLED_SIZE, readers.OFFICE_POOLED_SIZE)
    bad = tmp_path / "bad"
    write_png(bad / "dom" / "cls" / "a.png", np.zeros((4, 4, 3), np.uint8))
    (bad / "dom" / "cls" / "b.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(DataError, match="b.png: cannot decode"):
        load_domain_folders(bad, 8)


# ------------------------------------------------------------------------------------------ digits suite


def test_digits_domains(tmp_path):
    write_mnist(tmp_path / "mnist", n_train=20, n_test=6)
    write_usps_libsvm(tmp_path / "usps")
    doms = digits_domains(tmp_path)
    assert list(doms) == ["mnist", "usps", "synth"]  # no svhn files: skipped
    for ds in doms.values():
        assert ds.x_train.shape[1:] == (3, 28, 28) and ds.x_test.shape[1:] == (3, 28, 28)
        assert ds.x_train.dtype == np.uint8 and ds.num_classes == 10
    assert np.array_equal(doms["mnist"].x_train[:, 0], doms["mnist"].x_train[:, 2])
    assert doms["usps"].x_train.shape[0] == 9
    synth = doms["synth"]
    assert np.array_equal(synth.y_train, doms["mnist"].y_train)
    assert not np.array_equal(synth.x_train[:, 0], synth.x_train[:, 1])  # coloured
    clear_cache()
    again = digits_domains(tmp_path)
    assert np.array_equal(again["synth"].x_train, synth.x_train)  # seeded: identical
    other = digits_domains(tmp_path, seed=1)
    assert not np.array_equal(other["synth"].x_train, synth.x_train)
    big = digits_domains(tmp_path, size=32)
    assert {ds.x_train.shape[1:] for ds in big.values()} == {(3, 32, 32)}


def test_digits_domains_needs_two(tmp_path):
    write_usps_libsvm(tmp_path / "usps")
    with pytest.raises(DataError, match="at least 2 domains, found \\['usps'\\]"):
        digits_domains(tmp_path)


def test_resize_matches_bilinear():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(7).integers(0, 256, (5, 1, 16, 16), dtype=np.uint8)
    ours = readers._resize(x, 28).astype(int)
    ref = torch.nn.functional.interpolate(
        torch.from_numpy(x).float(), size=(28, 28), mode="bilinear", align_corners=False
    )
    assert np.abs(ours - ref.round().numpy()).max() <= 1


# ------------------------------------------------------------------------------------------ download


def test_download_md5_and_atomic(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload" * 100)
    md5 = hashlib.md5(src.read_bytes()).hexdigest()
    dest = tmp_path / "out" / "file.bin"
    with pytest.raises(DataError, match="MD5"):
        readers._download([src.as_uri()], dest, "0" * 32)
    assert not dest.exists() and list((tmp_path / "out").iterdir()) == []
    readers._download([(tmp_path / "nope").as_uri(), src.as_uri()], dest, md5)
    assert dest.read_bytes() == src.read_bytes()


def test_image_dataset_validates_shapes():
    with pytest.raises(DataError, match="one label per image"):
        ImageDataset("x", np.zeros((3, 1, 2, 2), np.uint8), np.zeros(2, np.int64), None, None, 2)


# ------------------------------------------------------------------------------------------ integration


def shared(name: str) -> Path:
    d = SHARED_DATA / name
    if not d.is_dir():
        pytest.skip(f"offline dataset {name!r} not present at {d} (only in the developers' checkout)")
    return d


def test_shared_mnist_counts():
    ds = load_dataset("mnist", shared("mnist"))
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert np.bincount(ds.y_train).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert np.bincount(ds.y_test).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert ds.x_train.max() == 255 and load_dataset("mnist", SHARED_DATA) is ds


def test_shared_fmnist_counts():
    ds = load_dataset("fmnist", shared("fashion-mnist").parent)
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert np.all(np.bincount(ds.y_train) == 6000) and np.all(np.bincount(ds.y_test) == 1000)


def test_shared_usps_counts():
    pytest.importorskip("h5py")
    d = shared("usps")
    ds = load_dataset("usps", d)
    assert ds.x_train.shape == (7291, 1, 16, 16) and ds.x_test.shape == (2007, 1, 16, 16)
    assert np.bincount(ds.y_train).tolist() == [1194, 1005, 731, 658, 652, 556, 664, 645, 542, 644]
    _, y = read_libsvm(d / "usps.t.bz2")
    assert np.array_equal(y - 1, ds.y_test)  # same test images, same order, as the official LIBSVM file


def test_download_flow_offline(tmp_path, monkeypatch):
    """download=True end to end, with file:// URLs standing in for the official servers."""
    import dataclasses

    server = tmp_path / "server"
    write_mnist(server)
    remote = tuple(
        readers._Remote(p.name, (p.as_uri(),), hashlib.md5(p.read_bytes()).hexdigest())
        for p in sorted(server.iterdir())
    )
    monkeypatch.setitem(readers._SPECS, "mnist", dataclasses.replace(readers._SPECS["mnist"], remote=remote))
    root = tmp_path / "root"
    with pytest.raises(DatasetNotFoundError, match="download=True"):
        load_dataset("mnist", root)
    ds = load_dataset("mnist", root, download=True)
    assert ds.x_train.shape == (12, 1, 28, 28)
    assert sorted(p.name for p in (root / "mnist").iterdir()) == sorted(p.name for p in server.iterdir())
    # an incomplete folder is completed from the server
    (root / "mnist" / "t10k-images-idx3-ubyte.gz").unlink()
    clear_cache()
    assert load_dataset("mnist", root, download=True).x_test.shape == (5, 1, 28, 28)
