"""Office-Caltech-10 as a domain suite (issue 30, item 1): tiny domain folders in the real layout, the federation
over the four domains, a 2-round FedHEAL run through the CLI, a missing domain, and `reproduce fedheal`'s Office
columns."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_no_leakage import _source, assert_no_leak
from test_readers import write_png

import fedskew.data.federated as fed
from fedskew.cli import main
from fedskew.config import make_config
from fedskew.data.readers import OFFICE_DOMAINS, DataError
from fedskew.data.readers.office import OFFICE_TEST_SHARE, office_domains
from fedskew.reproduce import load_paper, make_plan

CLASSES = ("back_pack", "bike", "mug")


def write_office(root: Path, domains=OFFICE_DOMAINS, per_class: int = 5) -> Path:
    """``root/office_caltech_10/<domain>/<class>/<i>.png`` (the release's layout: class folders directly, no test
    split), images of differing sizes per domain; returns the data directory."""
    r = np.random.default_rng(30)
    for k, dom in enumerate(domains):
        for c in CLASSES:
            for i in range(per_class):
                arr = r.integers(0, 256, (12 + 2 * k, 10 + k, 3), dtype=np.uint8)
                write_png(root / "office_caltech_10" / dom / c / f"{c}_{i}.png", arr)
    return root


def _cfg(data_dir: Path, **kw):
    values = {
        "dataset": "office_caltech",
        "partition": "domain",
        "data_dir": str(data_dir),
        "clients": 8,
        "domain_fraction": 0.4,
        "image_size": 8,
        "model": "mlp",
        "rounds": 1,
        "db": None,
        "device": "cpu",
    }
    return make_config(None, {**values, **kw})


def test_suite_reads_the_four_domains_with_a_fixed_test_split(tmp_path):
    write_office(tmp_path)
    doms = office_domains(tmp_path, size=8)
    assert list(doms) == list(OFFICE_DOMAINS)
    for d in doms.values():
        assert d.x_train.shape[1:] == (3, 8, 8) and d.num_classes == len(CLASSES)
        assert d.y_test is not None and np.bincount(d.y_test).tolist() == [round(5 * OFFICE_TEST_SHARE)] * 3
        assert len(d.y_train) + len(d.y_test) == 5 * len(CLASSES)
    again = office_domains(tmp_path, size=8)
    assert all(np.array_equal(doms[k].x_test, again[k].x_test) for k in doms)  # fixed, not drawn per call
    # the pooled reader still serves the other partitions
    make_config(None, {"dataset": "office_caltech", "partition": "dir", "data_dir": str(tmp_path), "db": None})


def test_federation_splits_clients_over_the_domains_without_leaks(tmp_path):
    write_office(tmp_path)
    cfg = _cfg(tmp_path)
    data = fed.build_federated(cfg.data_settings())
    assert data.domains == OFFICE_DOMAINS
    assert np.bincount(data.client_domain).tolist() == [2, 2, 2, 2]
    for c in data.clients:  # FedHEAL's repair: every client holds every class of its domain
        assert set(np.concatenate([c.y_train.numpy(), c.y_test.numpy()]).tolist()) == {0, 1, 2}
    assert_no_leak(data, _source(list(office_domains(tmp_path, size=8).values())))
    assert sorted(set(data.test_domain.tolist())) == [0, 1, 2, 3]


def test_fedheal_run_through_the_cli_records_per_domain_accuracy(tmp_path):
    data_dir = write_office(tmp_path / "data")
    out = tmp_path / "run"
    args = ["run", "--method", "fedavg+heal", "--dataset", "office_caltech", "--partition", "domain"]
    args += ["--data-dir", str(data_dir), "--clients", "4", "--rounds", "2", "--no-db", "--out", str(out)]
    args += ["--domain-fraction", "0.5", "--image-size", "8", "--model", "mlp", "--device", "cpu"]
    assert main(args) == 0
    last = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    accs = [last[f"domain_acc/{d}"] for d in OFFICE_DOMAINS]
    assert last["domain_acc_avg"] == pytest.approx(np.mean(accs))
    assert last["domain_acc_std"] == pytest.approx(np.std(accs, ddof=1))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["domains"] == list(OFFICE_DOMAINS) and summary["domains_missing"] == []


def test_a_missing_domain_is_named_and_the_rest_runs(tmp_path):
    write_office(tmp_path, domains=("amazon", "caltech", "webcam"))
    with pytest.warns(UserWarning, match=r"office_caltech: no files for dslr .* running on 3 domains"):
        data = fed.build_federated(_cfg(tmp_path, clients=6).data_settings())
    assert data.domains == ("amazon", "caltech", "webcam")
    from fedskew.recorder import domain_fields

    assert domain_fields(_cfg(tmp_path, clients=6), data.domains)["domains_missing"] == ["dslr"]
    shutil.rmtree(tmp_path / "office_caltech_10" / "caltech")
    shutil.rmtree(tmp_path / "office_caltech_10" / "webcam")
    with pytest.raises(DataError, match="at least 2 of the domain folders"):
        office_domains(tmp_path, size=8)


def test_reproduce_fedheal_runs_the_office_columns_when_present(tmp_path, capsys):
    data_dir = write_office(tmp_path / "data")
    plan = make_plan(load_paper("fedheal"), "smoke", data_dir=str(data_dir))
    (office,) = [s for s in plan.settings if s.id == "office"]
    assert office.domains == list(OFFICE_DOMAINS) and office.case["clients"] == 20
    assert office.case["domain_fraction"] == 0.1 and office.case["batch_size"] == 16
    code = main(["reproduce", "fedheal", "--scale", "smoke", "--dry-run", "--data-dir", str(data_dir)])
    text = capsys.readouterr()
    assert code == 0 and "Office-Caltech" in text.out + text.err

    empty = tmp_path / "empty"
    empty.mkdir()
    why = make_plan(load_paper("fedheal"), "smoke", data_dir=str(empty)).setting_reason("office")
    assert why and all(f"{d}/" in why for d in OFFICE_DOMAINS)
