"""NIID-Bench's partitions and protocol (``--protocol niid-bench``) against a port of its own code.

The ports below follow NIID-Bench's ``utils.partition_data`` line by line (Xtra-Computing/NIID-Bench), with its global
``np.random`` / ``random`` calls replaced by calls on one numpy ``Generator`` in the same order (``random.randint(0,
K-1)`` -> ``rng.integers(0, K)``, ``np.random.shuffle`` -> ``rng.shuffle``, ...): fedskew's partitioners consume their
generator in the benchmark's order, so the same seed gives the very same clients.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.data.niid_bench import noise_levels
from fedskew.data.partition import PartitionError, make_partition


def _labels(seed: int = 5, n: int = 3000, k: int = 10) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, k, size=n)


def port_label_count(y: np.ndarray, n_parties: int, num: int, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """NIID-Bench ``noniid-#label{num}`` (K = 10)."""
    K = 10
    times = [0 for _ in range(K)]
    contain = []
    for i in range(n_parties):
        current = [i % K]
        times[i % K] += 1
        j = 1
        while j < num:
            ind = int(rng.integers(0, K))  # random.randint(0, K - 1)
            if ind not in current:
                j = j + 1
                current.append(ind)
                times[ind] += 1
        contain.append(current)
    net = {i: np.ndarray(0, dtype=np.int64) for i in range(n_parties)}
    for i in range(K):
        idx_k = np.where(y == i)[0]
        rng.shuffle(idx_k)
        split = np.array_split(idx_k, times[i])
        ids = 0
        for j in range(n_parties):
            if i in contain[j]:
                net[j] = np.append(net[j], split[ids])
                ids += 1
    return net


def port_labeldir(y: np.ndarray, n_parties: int, beta: float, rng: np.random.Generator) -> dict[int, list[int]]:
    """NIID-Bench ``noniid-labeldir`` (min_require_size 10, K = 10)."""
    min_size, K, N = 0, 10, y.shape[0]
    while min_size < 10:
        idx_batch: list[list[int]] = [[] for _ in range(n_parties)]
        for k in range(K):
            idx_k = np.where(y == k)[0]
            rng.shuffle(idx_k)
            proportions = rng.dirichlet(np.repeat(beta, n_parties))
            proportions = np.array(
                [p * (len(idx_j) < N / n_parties) for p, idx_j in zip(proportions, idx_batch, strict=True)]
            )
            proportions = proportions / proportions.sum()
            proportions = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            idx_batch = [
                idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, proportions), strict=True)
            ]
            min_size = min([len(idx_j) for idx_j in idx_batch])
    return dict(enumerate(idx_batch))


def port_quantity(n_train: int, n_parties: int, beta: float, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """NIID-Bench ``iid-diff-quantity``."""
    idxs = rng.permutation(n_train)
    min_size = 0
    while min_size < 10:
        proportions = rng.dirichlet(np.repeat(beta, n_parties))
        proportions = proportions / proportions.sum()
        min_size = np.min(proportions * len(idxs))
    proportions = (np.cumsum(proportions) * len(idxs)).astype(int)[:-1]
    return dict(enumerate(np.split(idxs, proportions)))


def _same(ours: list[np.ndarray], theirs: dict) -> None:
    assert len(ours) == len(theirs)
    for i, part in enumerate(ours):
        np.testing.assert_array_equal(part, np.sort(np.asarray(theirs[i], dtype=np.int64)))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_label_count_is_niid_bench_partitioner(k: int, seed: int) -> None:
    y = _labels()
    ours = make_partition("pat", y, 10, np.random.default_rng(seed), classes_per_client=k, scheme="niid-bench")
    _same(ours, port_label_count(y, 10, k, np.random.default_rng(seed)))
    counts = np.array([[np.sum(y[p] == c) for c in range(10)] for p in ours])
    assert ((counts > 0).sum(axis=1) == k).all()  # exactly k labels per client
    assert (counts[np.arange(10), np.arange(10)] > 0).all()  # client i holds label i mod 10
    # a label's samples are cut into near-equal pieces among its holders (array_split)
    for c in range(10):
        held = counts[:, c][counts[:, c] > 0]
        assert held.max() - held.min() <= 1 and held.sum() == np.sum(y == c)


@pytest.mark.parametrize("seed", [0, 3])
def test_labeldir_is_niid_bench_partitioner(seed: int) -> None:
    y = _labels()
    ours = make_partition("dir", y, 10, np.random.default_rng(seed), alpha=0.5, min_size=10)
    _same(ours, port_labeldir(y, 10, 0.5, np.random.default_rng(seed)))


@pytest.mark.parametrize("seed", [0, 2])
def test_quantity_is_niid_bench_partitioner(seed: int) -> None:
    y = _labels()
    ours = make_partition("quantity", y, 10, np.random.default_rng(seed), beta=0.5, min_size=10, rule="niid-bench")
    _same(ours, port_quantity(len(y), 10, 0.5, np.random.default_rng(seed)))
    assert min(len(p) for p in ours) >= 10


def test_homo_is_a_permutation_array_split() -> None:
    y = _labels(n=1003)
    ours = make_partition("iid", y, 10, np.random.default_rng(4))
    _same(ours, dict(enumerate(np.array_split(np.random.default_rng(4).permutation(len(y)), 10))))


def test_label_count_refuses_an_uncovered_label_and_quantity_a_hopeless_minimum() -> None:
    y = _labels()
    with pytest.raises(PartitionError, match=r"no client drew classes \[.*\]"):
        make_partition("pat", y, 3, np.random.default_rng(0), classes_per_client=1, scheme="niid-bench")
    with pytest.raises(PartitionError, match="min_size"):
        make_partition(
            "quantity", y, 10, np.random.default_rng(0), beta=0.01, min_size=290, rule="niid-bench", max_retries=20
        )


def test_noise_levels_are_niid_benchs() -> None:
    np.testing.assert_allclose(noise_levels(0.1, 10), 0.1 * np.arange(10) / 9)
    assert noise_levels(0.1, 10)[0] == 0.0 and noise_levels(0.1, 10)[-1] == pytest.approx(0.1)
    assert noise_levels(0.1, 1).tolist() == [0.0]


def _cfg(**kw: object):
    return make_config({"protocol": "niid-bench", "dataset": "digits", "model": "mlp", "db": None, **kw})


def test_protocol_presets_and_refusals() -> None:
    cfg = _cfg()
    assert (cfg.clients, cfg.rounds, cfg.local_epochs, cfg.batch_size, cfg.lr) == (10, 50, 10, 64, 0.01)
    assert (cfg.momentum, cfg.weight_decay, cfg.partition, cfg.alpha, cfg.pat_scheme) == (
        0.9,
        1e-5,
        "dir",
        0.5,
        "niid-bench",
    )
    assert make_config({"protocol": "niid-bench", "db": None}).model == "lenet"
    with pytest.raises(Exception, match="protocol 'niid-bench' supports partitions"):
        _cfg(partition="niid2")
    with pytest.raises(Exception, match="feature_noise is NIID-Bench's"):
        make_config({"dataset": "digits", "feature_noise": 0.1, "db": None})


def test_clients_train_on_all_of_their_part_with_unit_pixels() -> None:
    data = build_federated(_cfg(partition="pat", classes_per_client=2))
    n_train = sum(len(c.y_train) for c in data.clients)
    n_test = len(data.y_test)
    assert n_train + n_test == 1797  # digits: every sample is either a client's training sample or a test sample
    assert sum(len(c.y_test) for c in data.clients) == n_test  # the clients' local tests: disjoint shares of it
    x = torch.cat([c.x_train for c in data.clients])
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0  # ToTensor's [0, 1], not fedskew's [-1, 1]
    assert all(len(torch.unique(c.y_train)) == 2 for c in data.clients)
    tr = np.concatenate([c.train_index for c in data.clients])
    assert len(np.intersect1d(tr, data.test_index)) == 0 and len(np.unique(tr)) == len(tr)


def test_feature_noise_per_client_and_the_noisy_test_copies() -> None:
    clean = build_federated(_cfg(partition="iid"))
    noisy = build_federated(_cfg(partition="iid", feature_noise=0.5, noise_draw="once"))
    levels = noise_levels(0.5, 10)
    for c0, c1, s in zip(clean.clients, noisy.clients, levels, strict=True):
        np.testing.assert_array_equal(c0.train_index, c1.train_index)
        diff = (c1.x_train - c0.x_train).flatten()
        assert float(diff.std()) == pytest.approx(s, abs=0.02 + 0.05 * s)
    n = len(clean.y_test)
    assert len(noisy.y_test) == 10 * n  # NIID-Bench's global test: the test split once per client noise level
    copies = noisy.x_test.reshape(10, n, *clean.x_test.shape[1:])
    torch.testing.assert_close(copies[0], clean.x_test)  # client 0's level is 0
    for i in (1, 9):
        assert float((copies[i] - clean.x_test).std()) == pytest.approx(levels[i], rel=0.05)
    # the same seed gives the same noise
    again = build_federated(_cfg(partition="iid", feature_noise=0.5, noise_draw="once"))
    torch.testing.assert_close(again.clients[3].x_train, noisy.clients[3].x_train)
    # noise_draw access (the default, NIID-Bench's data loader): the training data stay clean and carry the level
    access = build_federated(_cfg(partition="iid", feature_noise=0.5))
    for c0, c1, s in zip(clean.clients, access.clients, levels, strict=True):
        torch.testing.assert_close(c1.x_train, c0.x_train)
        assert c1.input_noise == pytest.approx(s) and c0.input_noise == 0.0
    torch.testing.assert_close(access.x_test, noisy.x_test)  # the test copies are the same either way


def test_access_noise_is_a_fresh_draw_for_every_batch() -> None:
    """local_train adds the client's noise to each batch as it draws it: a zero-lr pass sees noisy inputs (its loss
    differs from the clean one), two epochs see different draws, and the same generator seed repeats them exactly."""
    from fedskew.client.local import LocalContext, TrainSettings, local_train
    from fedskew.methods import resolve_method
    from fedskew.models import build_model

    torch.manual_seed(0)
    model = build_model("mlp", in_channels=1, image_size=8, num_classes=10)
    x, y = torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,))
    params = {k: v.clone() for k, v in model.state_dict().items()}

    def loss(noise: float, seed: int, epochs: int = 1) -> float:
        ctx = LocalContext(0, 1, model, params, {}, {}, TrainSettings(epochs=epochs, batch_size=64, lr=0.0))
        up = local_train(resolve_method("fedavg", {}).client, ctx, x, y, torch.Generator().manual_seed(seed), (), noise)
        return up.metrics["train_loss"]

    assert loss(0.0, 1) != loss(0.5, 1)
    assert loss(0.5, 1) == loss(0.5, 1)  # seeded
    assert loss(0.5, 1) != loss(0.5, 2)
    two = loss(0.5, 1, epochs=2)  # the mean of two different draws, not the first one twice
    assert two != loss(0.5, 1)


def test_access_noise_refuses_batching_and_flower_and_runs(tmp_path) -> None:
    import warnings

    from fedskew.flower.settings import parse_run_config
    from fedskew.runner import run_experiment
    from fedskew.schema import ConfigError

    cfg = _cfg(partition="iid", feature_noise=0.1, rounds=1, local_epochs=1, batched_clients=True, out=str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run_experiment(cfg)
    assert any("drawn at every access" in str(w.message) for w in caught)
    assert 0 <= out.summary["global_acc"]["final"] <= 1
    assert len(out.data.y_test) == 10 * 359  # the digits holdout (20% of 1,797), once per client noise level
    with pytest.raises(ConfigError, match="noise_draw once"):
        parse_run_config({"protocol": "niid-bench", "dataset": "digits", "feature_noise": 0.1})


# Flower's baselines/niid_bench README, "Expected Results", its table as printed there (tests/data): the source the
# package's ``flower`` table is checked against, cell by cell.
FLOWER_README = Path(__file__).parent / "data" / "flower_niid_bench_expected_results.md"
# NIID-Bench's own README leaderboard, its 10-party simple-CNN rows as printed there (tests/data).
LEADERBOARD_README = Path(__file__).parent / "data" / "niid_bench_leaderboard_10_parties.md"


def test_published_numbers_and_their_sources() -> None:
    from fedskew.reproduce.papers import load_paper, parse_value

    paper = load_paper("niidbench")
    assert paper.paper == "niid-bench" and paper.metric.statistic == "final" and paper.verdicts
    tables = {t.id: t for t in paper.tables}
    # Flower's table, every cell as its README prints it (method columns FedAvg, SCAFFOLD, FedProx, FedNova; rows
    # IID, Dir(0.5), #C=1, #C=2, #C=3), and the statistic it states: the best round
    flower = tables["flower"]
    assert flower.statistic == "best" and "best accuracies across all rounds" in flower.statistic_note
    prefix = {"MNIST": "mnist", "FMNIST": "fmnist", "CIFAR10": "c10"}
    checked = 0
    rows = [line for line in FLOWER_README.read_text().splitlines() if line.split("|")[1:2] != [" Dataset "]]
    for line in [r for r in rows if r.startswith("| ") and "<br>" in r]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for method, column in zip(("fedavg", "scaffold", "fedprox", "fednova"), cells[2:6], strict=True):
            printed = [v.replace("&#xB1;", "±").strip() for v in column.split("<br>")]
            for part, text in zip(("iid", "dir", "c1", "c2", "c3"), printed, strict=True):
                mean, std = (float(x) for x in text.split("±"))
                assert parse_value(flower.values[method][f"{prefix[cells[0]]}_{part}"]) == (mean, std), text
                checked += 1
    assert checked == 60 and sum(len(v) for v in flower.values.values()) == 60
    assert all(paper.settings[c.setting].dataset in ("mnist", "fmnist", "cifar10") for c in flower.column_list())
    # the benchmark's own leaderboard (its final round), every cell as its README prints it
    board = tables["leaderboard"]
    assert board.statistic is None
    column = {"`noniid-#label2`": "c10_c2", "`noniid-labeldir` with `beta=0.5`": "c10_dir"}
    column |= {"`homo` with `noise=0.1`": "c10_noise", "`iid-diff-quantity` with `beta=0.5`": "c10_qty"}
    row = {"FedAvg": "fedavg", "SCAFFOLD": "scaffold", "FedNova": "fednova"}
    row |= {"FedProx (`mu=0.01`)": "fedprox", "FedProx (`mu=0.001`)": "fedprox_mu0001"}
    printed = [line for line in LEADERBOARD_README.read_text().splitlines() if line.startswith("| `")]
    for line in printed:
        partition, model, rounds, method, acc = (c.strip() for c in line.strip("|").split("|"))
        assert (model, rounds) == ("`simple-cnn`", "50")
        assert parse_value(board.values[row[method]][column[partition]]) == (float(acc.rstrip("%")), None), line
    assert len(printed) == 16 and sum(len(v) for v in board.values.values()) == 16
    # the paper scale is the benchmark's own settings (no reduction)
    assert paper.scales["paper"].config == {
        "rounds": 50,
        "local_epochs": 10,
        "batch_size": 64,
        "lr": 0.01,
        "model": "lenet",
    }


def test_verdicts() -> None:
    from fedskew.reproduce.table import Cell, rounding, verdict

    def cell(vals: list[float], paper: tuple[float, float | None]) -> Cell:
        a = np.array(vals)
        return Cell(
            ours=(float(a.mean()), float(a.std()) if len(a) > 1 else None),
            seeds=len(a),
            paper=paper,
            values=dict(enumerate(vals)),
        )

    assert verdict(cell([98.8, 99.0, 98.9], (98.9, None))) == "reproduces"  # inside our spread
    assert verdict(cell([90.0, 91.0], (89.0, 1.0))) == "reproduces"  # within the two spreads (0.5 + 1.0)
    # outside both spreads but inside the t interval of the mean (3 seeds, wide)
    assert verdict(cell([80.0, 90.0, 100.0], (99.0, None))) == "reproduces"
    assert verdict(cell([98.8, 99.0, 98.9], (96.6, None))) == "does not reproduce"
    assert verdict(cell([55.0], (10.0, None))) == "not resolved (1 seed)"
    one = cell([98.89], (98.9, None))
    assert verdict(one) == "not resolved (1 seed)"  # no rounding given: an exact published number
    one.paper_rounding = rounding("98.9")
    assert one.paper_rounding == pytest.approx(0.05) and verdict(one) == "reproduces"  # within 98.9's rounding
    assert rounding("90.79±0.08") == pytest.approx(0.005) and rounding(10) == pytest.approx(0.5)
    assert verdict(cell([55.0], (50.0, 6.0))) == "reproduces"
    assert verdict(Cell(ours=None, paper=(10.0, None))) == ""


def test_each_table_reads_the_runs_with_its_own_statistic() -> None:
    """The leaderboard's cells are the final round's accuracy and Flower's the best round's, from the same runs;
    the verdict compares like with like."""
    from fedskew.reproduce import load_paper, make_plan
    from fedskew.reproduce.render import render_markdown
    from fedskew.reproduce.table import build_tables, verdict

    paper = load_paper("niid-bench")
    flower = next(t for t in paper.tables if t.id == "flower")
    final = flower.model_copy(update={"id": "flower_final", "statistic": None, "statistic_note": ""})
    paper = paper.model_copy(update={"tables": [flower, final]})
    plan = make_plan(paper, "smoke", rows=["fedavg"], settings=["mnist_iid"])
    assert [s.id for s in plan.settings] == ["digits_iid"]
    acc = {"final": 0.9850, "best": 0.9911, "best_round": 40, "last_n_mean": 0.98}
    runs = {("fedavg", "digits_iid"): [{"seed": 0, "summary": {"global_acc": acc}}]}
    by_best, by_final = build_tables(plan, runs, {})
    assert by_best.cells[("fedavg", 0)].ours == (pytest.approx(99.11), None)
    assert by_final.cells[("fedavg", 0)].ours == (pytest.approx(98.50), None)
    assert by_best.cells[("fedavg", 0)].paper == (99.09, 0.05)
    assert verdict(by_best.cells[("fedavg", 0)]) == "reproduces"  # 99.11 within 99.09 ± 0.05
    assert verdict(by_final.cells[("fedavg", 0)]) == "not resolved (1 seed)"
    text = render_markdown(plan, [by_best, by_final], [])
    assert text.count("Statistic of this table: best") == 1


def test_reproduce_smoke_and_dry_run(tmp_path, capsys, monkeypatch) -> None:
    """`fedskew reproduce niid-bench --scale smoke` (CI's pipeline check) writes the tables with a verdict column;
    `--dry-run` at scale paper lists every run and every setting that cannot run here with the reason."""
    from fedskew.cli import main

    monkeypatch.delenv("FEDSKEW_DATA", raising=False)
    out = tmp_path / "nb"
    argv = ["reproduce", "niid-bench", "--scale", "smoke", "--rows", "fedavg,scaffold", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    text = (out / "table.md").read_text()
    assert "| paper | Δ | verdict |" in text
    assert "Verdict: reproduces when the published mean lies inside" in text
    data = json.loads((out / "table.json").read_text())
    cells = [c for t in data["tables"] for r in t["rows"] for c in r["cells"]]
    assert cells and all(c["verdict"] == "" for c in cells)  # the digits stand-ins get no verdict
    assert any(c["ours"] for c in cells)  # the digits stand-ins ran
    assert "stand-in: no verdict" in text
    assert "Evaluation protocol (niid-bench): global_acc, the final round: global model on the global test set" in text
    assert "Statistic of this table: best (the README: 'the best accuracies across all rounds" in text
    assert "Evaluation protocol (niid-bench): global_acc, the best evaluated round" in text
    statistics = {t["id"]: t["statistic"] for t in data["tables"]}
    assert statistics == {"leaderboard": "final", "flower": "best", "unpublished_here": "final"}
    capsys.readouterr()
    data_dir = tmp_path / "empty"
    data_dir.mkdir()
    assert main(["reproduce", "niid-bench", "--scale", "paper", "--dry-run", "--data-dir", str(data_dir)]) == 2
    got = capsys.readouterr()
    plan = got.out + got.err  # nothing can run without the files: every setting listed with its reason
    assert "setting MNIST #C=1: dataset mnist not found" in plan and "setting CIFAR-10 x~Gau(0.1)" in plan
    assert main(["reproduce", "niid-bench", "--scale", "smoke", "--settings", "nope", "--dry-run"]) == 2
    assert "has no setting 'nope'" in capsys.readouterr().err


def test_cost_benchmark_counts_the_simple_cnns_work_and_runs() -> None:
    """benchmarks/niid_bench_cost.py: the multiply-adds it counts are the simple CNN's (conv 6x24x24x25 +
    16x8x8x150, FC 256x120 + 120x84 + 84x10), and its CI-sized call prints the run estimate (no time asserted)."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "niid_bench_cost.py"
    sys.path.insert(0, str(bench.parent))
    try:
        from niid_bench_cost import macs_per_sample
    finally:
        sys.path.pop(0)
    from fedskew.models import build_model

    model = build_model("lenet", in_channels=1, image_size=28, num_classes=10)
    expected = 6 * 24 * 24 * 25 + 16 * 8 * 8 * 150 + 256 * 120 + 120 * 84 + 84 * 10
    assert macs_per_sample(model, torch.zeros(2, 1, 28, 28)) == expected
    out = subprocess.run(
        [sys.executable, str(bench), "--samples", "256", "--repeats", "1", "--threads", "1", "--round-workers", "0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert "a run at the published settings" in out and "of the" in out and "matmul rate" in out


def test_rows_selector_names_a_row_alone_or_every_row_of_a_method() -> None:
    """`--rows fedprox` is both FedProx rows (mu 0.01 and mu 0.001); `=fedprox` is the mu 0.01 row alone, and an
    `=ID` that names no row is an error naming the selector and the rows there are."""
    from fedskew.config import ConfigError
    from fedskew.reproduce import load_paper, make_plan

    paper = load_paper("niid-bench")

    def ids(selectors: list[str]) -> list[str]:
        return [r.id for r in make_plan(paper, "smoke", rows=selectors, settings=["mnist_iid"]).rows]

    assert ids(["fedprox"]) == ["fedprox", "fedprox_mu0001"]
    assert ids(["=fedprox"]) == ["fedprox"]
    assert ids(["=fedprox_mu0001", "fedavg"]) == ["fedavg", "fedprox_mu0001"]  # table order, not selector order
    assert ids([" =FedProx "]) == ["fedprox"]  # as typed on a command line
    with pytest.raises(ConfigError, match=r"no row '=fedprox_mu'; rows: fedavg, fedprox, fedprox_mu0001.*=ID"):
        make_plan(paper, "smoke", rows=["=fedprox_mu"])
    with pytest.raises(ConfigError, match="no row '='"):
        make_plan(paper, "smoke", rows=["="])
