"""AG News (issue 30, item 3): tiny files in the official CSV format (class index 1..4, title, description; no
header), the tokenizer and the training-only vocabulary, the on-disk cache, named errors, token ids through the engine
and TextCNN, a 2-round FedAvg+Disco run under partial participation through the CLI, and `reproduce feddisco`'s
Table 4 columns."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedskew.cli import main
from fedskew.config import ConfigError, make_config
from fedskew.data.federated import build_federated
from fedskew.data.pools import input_shape, to_float
from fedskew.data.readers import DataError, clear_cache, load_dataset
from fedskew.data.readers.ag_news import (
    AG_CLASSES,
    AG_SEQ_LEN,
    build_vocabulary,
    encode,
    load_ag_news,
    read_vocabulary,
    tokenize,
)
from fedskew.data.readers.base import vocabulary_digest, vocabulary_text
from fedskew.engine.model_init import init_model
from fedskew.models import build_model, count_parameters, head_keys
from fedskew.reproduce import load_paper, make_plan

TOPICS = {
    1: "war election minister iraq troops",
    2: "game team season coach win",
    3: "stocks oil market profit shares",
    4: "software microsoft space internet nasa",
}


@pytest.fixture(autouse=True)
def _fresh():
    clear_cache()
    yield
    clear_cache()


def write_csv(path: Path, rows: list[list[object]]) -> Path:
    """Rows as the release writes them: every field quoted, no header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)
    return path


def write_ag(d: Path, n_train: int = 80, n_test: int = 20, seed: int = 0) -> Path:
    """``d/train.csv`` and ``d/test.csv``: each class's rows use its own topic words plus common ones; the test split
    alone holds the word 'zeppelin'."""
    r = np.random.default_rng(seed)
    common = ["the", "a", "of", "in", "to", "and", "says", "new"]

    def rows(n: int, extra: str) -> list[list[object]]:
        out: list[list[object]] = []
        for i in range(n):
            c = i % 4 + 1
            words = TOPICS[c].split() + common
            title = " ".join(r.choice(words, 4)).title()
            desc = " ".join(r.choice(words, 12)) + f" {extra}\\band #39;s"
            out.append([c, title, desc])
        return out

    write_csv(d / "train.csv", rows(n_train, "report"))
    write_csv(d / "test.csv", rows(n_test, "zeppelin"))
    return d


# ---- the tokenizer and the vocabulary --------------------------------------------------------------------------


def test_tokenizer_and_vocabulary():
    assert tokenize("Wall St. Bears Claw Back\\band #39;s (Reuters)") == [
        "wall",
        "st",
        "bears",
        "claw",
        "back",
        "band",
        "39",
        "s",
        "reuters",
    ]
    assert tokenize("Café_au-lait 3D") == ["café", "au", "lait", "3d"]
    voc = build_vocabulary(["b a a", "c b a", "d"], max_vocab=10, min_freq=1)
    assert voc == ("<pad>", "<unk>", "a", "b", "c", "d")  # by frequency, ties alphabetically
    assert build_vocabulary(["b a a", "c b a", "d"], max_vocab=10, min_freq=2) == ("<pad>", "<unk>", "a", "b")
    assert build_vocabulary(["b a a", "c b a", "d"], max_vocab=3, min_freq=1) == ("<pad>", "<unk>", "a")
    ids = encode(["a zz b", "d c b a a a"], voc, 4)
    assert ids.dtype == np.int64 and ids.tolist() == [[2, 1, 3, 0], [5, 4, 3, 2]]  # unknown 1, pad 0, truncated


# ---- the reader --------------------------------------------------------------------------------------------------


def test_reader_shapes_labels_and_training_only_vocabulary(tmp_path):
    d = write_ag(tmp_path / "ag_news_csv")
    ds = load_ag_news(d)
    assert ds.name == "ag_news" and ds.num_classes == 4 and ds.classes == AG_CLASSES
    assert ds.x_train.shape == (80, AG_SEQ_LEN) and ds.x_train.dtype == np.int64
    assert ds.x_test is not None and ds.x_test.shape == (20, AG_SEQ_LEN)
    assert ds.y_train.tolist() == [i % 4 for i in range(80)]
    assert ds.vocabulary[:2] == ("<pad>", "<unk>") and "report" in ds.vocabulary
    assert "zeppelin" not in ds.vocabulary  # built from the training split only
    assert (ds.x_test == 1).sum(axis=1).min() >= 1  # the test-only word is <unk> in every test sample
    assert ds.x_train.max() < len(ds.vocabulary) and ds.x_test.max() < len(ds.vocabulary)
    short = load_ag_news(d, seq_len=8, min_freq=1, max_vocab=12)
    assert short.x_train.shape == (80, 8) and len(short.vocabulary) == 12 and (short.x_train != 0).all()
    # found through the registry: the data root with an ag_news_csv folder, by name or alias
    assert np.array_equal(load_dataset("ag-news", tmp_path).x_train, ds.x_train)


def test_cache_and_saved_vocabulary(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("FEDSKEW_CACHE", str(cache))
    d = write_ag(tmp_path / "ag")
    ds = load_ag_news(d)
    (entry,) = cache.glob("ag_news-*.npz")
    import fedskew.data.readers.ag_news as ag

    def refuse(path):
        raise AssertionError(f"{path} read again although cached")

    monkeypatch.setattr(ag, "read_ag_csv", refuse)
    again = load_ag_news(d)
    assert again.vocabulary == ds.vocabulary and np.array_equal(again.x_test, ds.x_test)
    monkeypatch.undo()
    monkeypatch.setenv("FEDSKEW_CACHE", str(cache))
    # other options: another entry; a vocabulary saved by a run gives the same ids
    saved = tmp_path / "vocab.txt"
    saved.write_text(vocabulary_text(ds.vocabulary))
    assert read_vocabulary(saved) == ds.vocabulary
    same = load_ag_news(d, vocab_file=saved)
    assert np.array_equal(same.x_train, ds.x_train) and len(list(cache.glob("ag_news-*.npz"))) == 2
    assert entry.is_file()
    saved.write_text("a\nb\n")
    with pytest.raises(DataError, match="not a vocabulary"):
        load_ag_news(d, vocab_file=saved)


def test_named_errors(tmp_path):
    d = tmp_path / "ag"
    with pytest.raises(DataError, match=r"train\.csv: file not found"):
        load_ag_news(write_csv(d / "test.csv", [[1, "t", "d"]]).parent)
    write_csv(d / "train.csv", [[1, "t", "d"]])
    (d / "test.csv").unlink()
    with pytest.raises(DataError, match=r"test\.csv: file not found"):
        load_ag_news(d)
    (d / "test.csv").write_text("")
    with pytest.raises(DataError, match=r"test\.csv: no rows \(empty file\)"):
        load_ag_news(d)
    write_csv(d / "test.csv", [[1, "t", "d"], [2, "only a title"]])
    with pytest.raises(DataError, match=r"test\.csv, line 2: expected 3 columns .* got 2"):
        load_ag_news(d)
    write_csv(d / "train.csv", [[1, "t", "d"], [4, "t", "d"], [5, "t", "d"]])
    write_csv(d / "test.csv", [[1, "t", "d"]])
    with pytest.raises(DataError, match=r"train\.csv, line 3: class index '5' is not one of 1, 2, 3, 4"):
        load_ag_news(d)
    write_csv(d / "train.csv", [[1, "t", "d"], ["World", "t", "d"]])
    with pytest.raises(DataError, match="line 2: class index 'World'"):
        load_ag_news(d)
    (d / "train.csv").write_bytes(b'"1","caf\xe9","d"\n')
    with pytest.raises(DataError, match=r"train\.csv: cannot read"):
        load_ag_news(d)
    write_csv(d / "train.csv", [["Class Index", "Title", "Description"], [3, "t", "d"]])  # the Kaggle header
    assert load_ag_news(d).y_train.tolist() == [2]
    with pytest.raises(DataError, match="seq_len must be an integer >= 1"):
        load_ag_news(d, seq_len=0)
    with pytest.raises(DataError, match="dataset 'ag_news' not found.*train.csv and test.csv"):
        load_dataset("ag_news", tmp_path / "nowhere")


# ---- token ids through the engine, and TextCNN ---------------------------------------------------------------------


def test_token_ids_stay_integers_and_images_are_unchanged():
    ids = np.array([[2, 3, 0], [1, 4, 0]], dtype=np.int64)
    t = to_float(ids, "cpu")
    assert t.dtype == torch.int64 and t.tolist() == ids.tolist()
    assert input_shape(ids, 10) == (10, 3) and input_shape(ids) == (5, 3)
    img = np.array([[[[0, 255], [128, 64]]]], dtype=np.uint8)
    assert torch.equal(to_float(img, "cpu"), torch.from_numpy(img).float() / 127.5 - 1.0)
    assert input_shape(img) == (1, 2)
    feats = np.ones((3, 5), dtype=np.float64)
    assert to_float(feats, "cpu").dtype == torch.float32 and input_shape(feats) == (5, 1)


def test_textcnn_body_head_and_projection():
    model = build_model("textcnn", in_channels=50, image_size=12, num_classes=4)
    x = torch.randint(0, 50, (3, 12))
    assert model(x).shape == (3, 4) and model.features(x).shape == (3, 300)
    assert head_keys(model) == {"head.weight", "head.bias"}
    assert all(k.startswith(("body.", "head.")) for k in model.state_dict())
    assert torch.all(model.state_dict()["body.0.embedding.weight"][0] == 0)  # the padding id embeds to 0
    # embedding 50x128 + convolutions 128x100x(3+4+5) + 300 biases + head 300x4 + 4
    assert count_parameters(model) == 50 * 128 + 128 * 100 * 12 + 300 + 1204
    moon = build_model("textcnn", in_channels=50, image_size=12, num_classes=4, projection=16)
    assert moon(x).shape == (3, 4) and moon.features(x).shape == (3, 16)
    with pytest.raises(ValueError, match="shorter than its widest convolution"):
        build_model("textcnn", in_channels=50, image_size=4, num_classes=4)


def test_auto_picks_textcnn_and_mismatches_are_named(tmp_path):
    d = write_ag(tmp_path / "ag")
    base = {"dataset": "ag_news", "data_dir": str(d), "partition": "biased", "clients": 5, "db": None}
    cfg = make_config(base)
    data = build_federated(cfg)
    assert data.holds_tokens and data.vocabulary == load_ag_news(d).vocabulary
    assert (data.in_channels, data.image_size) == (len(data.vocabulary), AG_SEQ_LEN)
    assert data.clients[0].x_train.dtype == torch.int64 and data.x_test.dtype == torch.int64
    model = init_model(cfg, data)
    assert model(data.x_test[:2]).shape == (2, 4)
    with pytest.raises(ConfigError, match="holds token ids"):
        init_model(make_config({**base, "model": "mlp"}), data)
    digits_cfg = make_config({"model": "textcnn", "db": None})
    with pytest.raises(ConfigError, match="model 'textcnn' reads token ids"):
        init_model(digits_cfg, build_federated(digits_cfg))


def test_fedavg_disco_partial_participation_through_the_cli(tmp_path):
    data_dir = write_ag(tmp_path / "data" / "ag_news_csv", n_train=120, n_test=40)
    out = tmp_path / "run"
    args = ["run", "--method", "fedavg+disco", "--dataset", "ag_news", "--data-dir", str(data_dir.parent)]
    args += ["--partition", "biased", "--clients", "10", "--uniform-clients", "2", "--join-ratio", "0.5"]
    args += ["--rounds", "2", "--no-db", "--out", str(out), "--device", "cpu"]
    assert main(args) == 0
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rounds) == 2 and 0.0 <= rounds[-1]["global_acc"] <= 1.0
    voc = load_ag_news(data_dir).vocabulary
    assert read_vocabulary(out / "vocab.txt") == voc  # saved with the run: evaluation can use the same ids
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "textcnn"
    assert summary["vocabulary"] == {"file": "vocab.txt", "size": len(voc), "sha1": vocabulary_digest(voc)}
    hists = json.loads((out / "clients.json").read_text())
    assert hists  # the per-client label table is written as for images


# ---- reproduce feddisco: Table 4 ---------------------------------------------------------------------------------


def test_reproduce_feddisco_lists_the_ag_news_columns(tmp_path):
    paper = load_paper("feddisco")
    (t4,) = [t for t in paper.tables if t.id == "table4"]
    assert t4.values["fedavg_disco"] == {"ag_full": 84.09, "ag_partial": 57.71}
    data_dir = write_ag(tmp_path / "data" / "ag_news_csv").parent
    for scale in ("smoke", "small", "paper"):
        plan = make_plan(paper, scale, data_dir=str(data_dir))
        ag = {s.id: s.case for s in plan.settings if s.id.startswith("ag_")}
        assert set(ag) == {"ag_full", "ag_partial"}, scale
        assert ag["ag_full"]["model"] == "textcnn" and ag["ag_partial"]["join_ratio"] < 1
        assert plan.setting_reason("ag_full") is None
    empty = tmp_path / "empty"
    empty.mkdir()
    why = make_plan(paper, "smoke", data_dir=str(empty)).setting_reason("ag_partial")
    assert why and "AG News files not found: missing train.csv, test.csv" in why
    write_csv(empty / "train.csv", [[1, "t", "d"]])
    why = make_plan(paper, "small", data_dir=str(empty)).setting_reason("ag_full")
    assert why and "missing test.csv" in why and "train.csv" not in why.split("(searched")[0]


def test_the_vocabulary_is_one_of_the_run_directorys_own_files():
    """Issue 46: a text run that failed in round 1 left vocab.txt behind, and then its --out was refused even with
    --overwrite (the file was not one fedskew removes); an overwritten run kept a stale vocabulary."""
    from fedskew.data.readers.base import VOCAB_FILE
    from fedskew.results.rundir import OWN_FILES

    assert VOCAB_FILE in OWN_FILES
