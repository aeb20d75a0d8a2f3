"""HAM10000 (issue 30, item 2): tiny files in the official release's layout (metadata CSV, two JPEG folders), the
reader's classes, shapes and uniform held-out test split, named errors, a 2-round FedAvg+Disco run through the CLI,
and `reproduce feddisco`'s HAM column."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedskew.cli import main
from fedskew.data.readers import DataError, clear_cache, load_dataset
from fedskew.data.readers.ham10000 import HAM_CLASSES, HAM_METADATA, HAM_PARTS, load_ham10000, uniform_test_split
from fedskew.reproduce import load_paper, make_plan

HEADER = "lesion_id,image_id,dx,dx_type,age,sex,localization"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSKEW_CACHE", str(tmp_path / "cache"))
    clear_cache()
    yield
    clear_cache()


def write_ham(d: Path, per_class: int = 10, extra_rows: tuple[str, ...] = (), skip: str | None = None) -> Path:
    """``d/HAM10000_metadata.csv`` with ``per_class`` rows of every class and ``d/HAM10000_images_part_{1,2}/
    <image_id>.jpg`` (alternating folders, JPEGs of differing sizes); ``skip``: an image id left unwritten."""
    from PIL import Image

    r = np.random.default_rng(7)
    lines = [HEADER]
    n = 0
    for c in HAM_CLASSES:
        for _ in range(per_class):
            iid = f"ISIC_{n:07d}"
            lines.append(f"HAM_{n // 2:07d},{iid},{c},histo,50.0,male,back")
            if iid != skip:
                folder = d / HAM_PARTS[n % 2]
                folder.mkdir(parents=True, exist_ok=True)
                arr = r.integers(0, 256, (9 + n % 3, 12, 3), dtype=np.uint8)
                Image.fromarray(arr).save(folder / f"{iid}.jpg", format="JPEG")
            n += 1
    (d / HAM_METADATA).write_text("\n".join([*lines, *extra_rows]) + "\n")
    return d


def test_reader_classes_shapes_and_uniform_test_split(tmp_path):
    d = write_ham(tmp_path / "ham10000")
    ds = load_ham10000(d, resize=8, ham_test_per_class=3)
    assert ds.classes == HAM_CLASSES and ds.num_classes == 7
    assert ds.x_train.shape == (7 * 7, 3, 8, 8) and ds.x_train.dtype == np.uint8
    assert ds.y_test is not None and np.bincount(ds.y_test).tolist() == [3] * 7  # uniform: equal per class
    assert np.bincount(ds.y_train).tolist() == [7] * 7
    # disjoint: no test image is among the training images (random JPEGs are all different)
    tr = {a.tobytes() for a in ds.x_train}
    assert not any(a.tobytes() in tr for a in ds.x_test)
    again = load_ham10000(d, resize=8, ham_test_per_class=3)
    assert np.array_equal(ds.x_test, again.x_test)  # fixed by the seed, not drawn per call
    other = load_ham10000(d, resize=8, ham_test_per_class=3, ham_test_seed=1)
    assert not np.array_equal(ds.x_test, other.x_test)
    # the default (30 per class) is capped at half of the smallest class; found through the registry's subdirs
    full = load_dataset("ham10000", tmp_path)
    assert full.x_train.shape[1:] == (3, 32, 32) and np.bincount(full.y_test).tolist() == [5] * 7


def test_uniform_split_indices():
    y = np.repeat(np.arange(3), [10, 4, 6])
    tr, te = uniform_test_split(y, 3, seed=2)
    assert np.bincount(y[te]).tolist() == [2, 2, 2] and len(np.intersect1d(tr, te)) == 0 and len(tr) + len(te) == 20
    with pytest.raises(DataError, match="ham_test_per_class"):
        uniform_test_split(y, 0)


def test_named_errors(tmp_path):
    with pytest.raises(DataError, match=r"HAM10000_metadata\.csv: metadata file missing"):
        load_ham10000(tmp_path)
    (tmp_path / HAM_METADATA).write_text("lesion_id,image,diagnosis\nHAM_1,ISIC_1,nv\n")
    with pytest.raises(DataError, match="image_id, dx missing"):
        load_ham10000(tmp_path)
    d = write_ham(tmp_path / "a", per_class=2, skip="ISIC_0000003")
    with pytest.raises(DataError, match=r"ISIC_0000003\.jpg listed in HAM10000_metadata\.csv but missing"):
        load_ham10000(d)
    d = write_ham(tmp_path / "b", per_class=2, extra_rows=("HAM_9,ISIC_0000000,melanoma,histo,1,male,back",))
    with pytest.raises(DataError, match="line 16: unknown dx 'melanoma'"):
        load_ham10000(d)


def test_fedavg_disco_run_through_the_cli(tmp_path):
    data_dir = write_ham(tmp_path / "data", per_class=12)
    out = tmp_path / "run"
    args = ["run", "--method", "fedavg+disco", "--dataset", "ham10000", "--data-dir", str(data_dir)]
    args += ["--partition", "dir", "--alpha", "0.5", "--clients", "3", "--rounds", "2", "--no-db", "--out", str(out)]
    args += ["--resize", "8", "--model", "mlp", "--device", "cpu"]
    assert main(args) == 0
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= rounds[-1]["global_acc"] <= 1.0


def test_reproduce_feddisco_lists_the_ham_column(tmp_path):
    data_dir = write_ham(tmp_path / "data")
    plan = make_plan(load_paper("feddisco"), "small", data_dir=str(data_dir))
    (ham,) = [s for s in plan.settings if s.id == "ham_niid1"]
    assert ham.case["dataset"] == "ham10000" and ham.case["model"] == "resnet18" and ham.case["norm"] == "gn"
    assert plan.setting_reason("ham_niid1") is None

    empty = tmp_path / "empty"
    empty.mkdir()
    why = make_plan(load_paper("feddisco"), "small", data_dir=str(empty)).setting_reason("ham_niid1")
    assert why and HAM_METADATA in why and all(f"{p}/" in why for p in HAM_PARTS)
    (empty / HAM_METADATA).write_text(HEADER + "\n")
    why = make_plan(load_paper("feddisco"), "small", data_dir=str(empty)).setting_reason("ham_niid1")
    assert why and HAM_METADATA not in why and "HAM10000_images_part_1/" in why
