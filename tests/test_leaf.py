"""LEAF's JSON format (FEMNIST, Shakespeare, Sent140): natural clients read from tiny files the tests write in LEAF's
own layout, end to end through `fedskew run`, and every malformed file refused with the file and user named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedskew.cli import main
from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.data.readers import load_source
from fedskew.data.readers.base import DataError
from fedskew.data.readers.leaf import LEAF_LETTERS

RNG = np.random.default_rng(0)


def _write(path: Path, users: dict[str, tuple[list, list]], counts: list[int] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "users": list(users),
        "num_samples": counts if counts is not None else [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    path.write_text(json.dumps(doc))


def _femnist_user(n: int, labels: list[int]) -> tuple[list, list]:
    return [RNG.random(784).round(3).tolist() for _ in range(n)], [labels[i % len(labels)] for i in range(n)]


def _femnist(root: Path, split: bool = True) -> Path:
    users = {f"f{k:04d}_{k}": _femnist_user(12, [k, k + 10, 61]) for k in range(4)}
    if split:
        _write(
            root / "train" / "all_data_0_niid_0_keep_0_train_9.json", {u: (x[:9], y[:9]) for u, (x, y) in users.items()}
        )
        _write(
            root / "test" / "all_data_0_niid_0_keep_0_test_9.json", {u: (x[9:], y[9:]) for u, (x, y) in users.items()}
        )
    else:
        _write(root / "all_data" / "all_data_0.json", users)
    return root


def _shakespeare(root: Path) -> Path:
    def user(seed: int) -> tuple[list, list]:
        r = np.random.default_rng(seed)
        x = ["".join(r.choice(list(LEAF_LETTERS), size=80)) for _ in range(10)]
        return x, [str(r.choice(list(LEAF_LETTERS))) for _ in range(10)]

    users = {f"THE_TEMPEST_{role}": user(i) for i, role in enumerate(("PROSPERO", "MIRANDA", "ARIEL"))}
    _write(root / "train" / "all_data_niid_0_keep_0_train_9.json", {u: (x[:8], y[:8]) for u, (x, y) in users.items()})
    _write(root / "test" / "all_data_niid_0_keep_0_test_9.json", {u: (x[8:], y[8:]) for u, (x, y) in users.items()})
    return root


def _sent140(root: Path) -> Path:
    words = ["good", "bad", "happy", "sad", "love", "hate", "day", "night"]

    def tweet(i: int, label: int) -> list:
        text = " ".join(RNG.choice(words[label::2], size=6)) + " Zzq"
        return [str(1467810369 + i), "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", "user", text]

    users = {}
    for k in range(3):
        labels = [int(v) for v in RNG.integers(0, 2, size=10)]
        users[f"user{k}"] = ([tweet(10 * k + i, lab) for i, lab in enumerate(labels)], labels)
    _write(root / "all_data" / "all_data_0.json", users)
    return root


def test_femnist_split_by_sample_is_one_client_per_writer(tmp_path) -> None:
    src = load_source("femnist", str(_femnist(tmp_path / "femnist")))
    assert src.num_clients == 4 and src.num_classes == 62 and src.sources[0] == "f0000_0"
    assert src.x_train[0].shape == (9, 1, 28, 28) and src.x_test[0].shape == (3, 1, 28, 28)
    assert src.y_train[2].tolist()[:3] == [2, 12, 61]
    cfg = make_config(
        {"dataset": "femnist", "data_dir": str(tmp_path / "femnist"), "partition": "given", "clients": 4, "db": None}
    )
    data = build_federated(cfg)
    # every writer's samples on one client, train and test disjoint by source index
    assert [len(c.y_train) for c in data.clients] == [9] * 4 and [len(c.y_test) for c in data.clients] == [3] * 4
    tr = np.concatenate([c.train_index for c in data.clients])
    assert not set(tr) & set(np.concatenate([c.test_index for c in data.clients]))


def test_natural_partition_samples_writers_seeded(tmp_path) -> None:
    d = str(_femnist(tmp_path / "femnist", split=False))
    cfg = {"dataset": "femnist", "data_dir": d, "partition": "natural", "clients": 2, "db": None}
    a, b = build_federated(make_config({**cfg, "seed": 3})), build_federated(make_config({**cfg, "seed": 3}))
    assert [c.train_index.tolist() for c in a.clients] == [c.train_index.tolist() for c in b.clients]
    picked = {tuple(sorted(np.concatenate([c.train_index, c.test_index]))) for c in a.clients}
    # a client is one writer's 12 samples (unsplit: split with train_ratio), never a mix
    writers = [tuple(range(12 * k, 12 * k + 12)) for k in range(4)]
    assert picked <= set(writers) and len(picked) == 2
    with pytest.raises(Exception, match="holds 4 clients but clients=5"):
        build_federated(make_config({**cfg, "clients": 5}))
    with pytest.raises(Exception, match="or --partition natural"):
        build_federated(make_config({**cfg, "partition": "given", "clients": 2}))


def test_shakespeare_and_sent140_become_token_ids(tmp_path) -> None:
    sh = load_source("shakespeare", str(_shakespeare(tmp_path / "sh")))
    assert sh.num_classes == 80 and sh.x_train[0].dtype == np.int64 and sh.x_train[0].shape == (8, 80)
    x = sh.x_train[1][0]
    assert (
        "".join(LEAF_LETTERS[i] for i in x)
        == json.loads((tmp_path / "sh" / "train" / "all_data_niid_0_keep_0_train_9.json").read_text())["user_data"][
            "THE_TEMPEST_MIRANDA"
        ]["x"][0]
    )
    s140 = load_source("sent140", str(_sent140(tmp_path / "s140")))
    assert s140.num_classes == 2 and s140.x_train[0].shape == (10, 25) and s140.x_test is None
    vocab = s140.meta["vocabulary"]
    assert vocab[:2] == ["<pad>", "<unk>"] and "good" in vocab and "zzq" in vocab  # seen in every tweet


@pytest.mark.parametrize(
    ("dataset", "make", "model", "clients"),
    [
        ("femnist", _femnist, "mlp", 4),
        ("shakespeare", _shakespeare, "charlstm", 3),
        ("sent140", _sent140, "textcnn", 3),
    ],
)
def test_fedskew_run_on_each_leaf_task(tmp_path, capsys, dataset, make, model, clients) -> None:
    d = str(make(tmp_path / dataset))
    argv = ["run", "--dataset", dataset, "--data-dir", d, "--partition", "natural", "--clients", str(clients)]
    argv += ["--model", model, "--rounds", "1", "--local-epochs", "1", "--out", str(tmp_path / "run"), "--no-db"]
    assert main(argv) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0.0 <= summary["global_acc"]["final"] <= 1.0


def test_malformed_leaf_files_are_refused_by_name(tmp_path) -> None:
    def refused(files: dict[str, object], match: str) -> None:
        root = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        for rel, doc in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(doc if isinstance(doc, str) else json.dumps(doc))
        with pytest.raises(DataError, match=match):
            load_source("femnist", str(root))

    ok = {"users": ["a"], "num_samples": [1], "user_data": {"a": {"x": [[0.5] * 784], "y": [3]}}}
    refused({"all_data/x.json": "{not json"}, "not a readable LEAF JSON file")
    refused({"all_data/x.json": {"users": ["a"]}}, "holds 'users', 'num_samples' and 'user_data'")
    refused({"all_data/x.json": {**ok, "users": ["a", "b"], "num_samples": [1, 1]}}, "user 'b' is listed but has no")
    refused({"all_data/x.json": {**ok, "num_samples": [2]}}, "num_samples says 2, user_data holds 1")
    refused({"all_data/x.json": {**ok, "user_data": {"a": {"x": [[0.5] * 784], "y": [3, 4]}}}}, "1 samples but 2")
    refused({"all_data/x.json": {**ok, "user_data": {"a": {"x": [[0.5] * 700], "y": [3]}}}}, "784 pixel values")
    refused({"all_data/x.json": {**ok, "user_data": {"a": {"x": [[0.5] * 784], "y": [62]}}}}, "labels must be")
    refused({"all_data/x.json": {**ok, "user_data": {"a": {"x": [[0.5] * 783 + ["w"]], "y": [1]}}}}, "784 numbers")
    two = {"users": ["a", "b"], "num_samples": [1, 1], "user_data": {u: ok["user_data"]["a"] for u in "ab"}}
    refused(
        {
            "train/x.json": two,
            "test/y.json": {
                **two,
                "users": ["b", "c"],
                "user_data": {"b": ok["user_data"]["a"], "c": ok["user_data"]["a"]},
            },
        },
        "share some users",
    )
    refused({"train/x.json": ok}, "need both train/ and test/")
    refused({"all_data/x.json": ok, "all_data/y.json": ok}, "appears in two files")
    bad_char = {"users": ["r"], "num_samples": [1], "user_data": {"r": {"x": ["ab\u00e9"], "y": ["c"]}}}
    root = tmp_path / "badsh"
    (root / "all_data").mkdir(parents=True)
    (root / "all_data" / "x.json").write_text(json.dumps(bad_char))
    with pytest.raises(DataError, match="not in LEAF's 80-letter alphabet"):
        load_source("shakespeare", str(root))


def test_a_split_by_user_runs_its_test_users_as_heldout_clients(tmp_path, capsys) -> None:
    """LEAF's split by user (-t user): the test users never train; fedskew runs them as held-out clients after the
    training users, and says how when the settings do not."""
    users = {f"f{k}": _femnist_user(12, [k, k + 1]) for k in range(5)}
    root = tmp_path / "byuser"
    _write(root / "train" / "t.json", {u: users[u] for u in ("f0", "f1", "f2")})
    _write(root / "test" / "t.json", {u: users[u] for u in ("f3", "f4")})
    src = load_source("femnist", str(root))
    assert src.sources == ["f0", "f1", "f2", "f3", "f4"] and src.meta["heldout_users"] == 2 and src.x_test is None
    base = {"dataset": "femnist", "data_dir": str(root), "partition": "given", "clients": 5, "db": None}
    with pytest.raises(Exception, match="--partition given --clients 5 --heldout-clients 2"):
        build_federated(make_config(base))
    data = build_federated(make_config({**base, "heldout_clients": 2}))
    assert [c.cid for c in data.clients] == [0, 1, 2] and [c.cid for c in data.heldout] == [3, 4]
    argv = ["run", "--dataset", "femnist", "--data-dir", str(root), "--partition", "given", "--clients", "5"]
    argv += ["--heldout-clients", "2", "--rounds", "1", "--local-epochs", "1", "--model", "mlp", "--no-db"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0.0 <= summary["heldout_acc"]["final"] <= 1.0
