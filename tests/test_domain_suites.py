"""PACS, Office-Home and DomainNet as domain suites, read from tiny folders the tests write in their official layouts
(domain folders of class folders; DomainNet's split lists), end to end under --partition domain."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedskew.cli import main
from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.data.readers.base import DataError
from fedskew.data.readers.domain_suites import SUITES, suite_domains

Image = pytest.importorskip("PIL.Image")
RNG = np.random.default_rng(0)


def _folders(root: Path, domains: list[str], classes: list[str], per: int = 6) -> Path:
    for d in domains:
        for c in classes:
            (root / d / c).mkdir(parents=True, exist_ok=True)
            for i in range(per):
                px = RNG.integers(0, 256, size=(10, 12, 3), dtype=np.uint8)
                Image.fromarray(px).save(root / d / c / f"{d}_{c}_{i}.png")
    return root


def _suite(name: str):
    return next(s for s in SUITES if s.name == name)


def test_pacs_domains_with_a_fixed_holdout_and_shared_labels(tmp_path) -> None:
    root = _folders(tmp_path / "PACS" / "kfold", ["art_painting", "sketch"], ["dog", "horse"])
    doms = suite_domains(_suite("pacs"), tmp_path, 8)
    assert list(doms) == ["art_painting", "sketch"]  # the suite's order, the domains present
    art = doms["art_painting"]
    assert art.x_train.shape[1:] == (3, 8, 8) and art.classes == ("dog", "horse")
    assert len(art.y_train) + len(art.y_test) == 12 and sorted(set(art.y_test.tolist())) == [0, 1]
    again = suite_domains(_suite("pacs"), tmp_path, 8)  # the holdout does not depend on the run
    np.testing.assert_array_equal(again["sketch"].y_test, doms["sketch"].y_test)
    assert root.is_dir()


def test_office_home_real_world_folder_and_a_run_under_domain_skew(tmp_path, capsys) -> None:
    _folders(tmp_path / "OfficeHomeDataset_10072016", ["Art", "Real World"], ["Alarm_Clock", "Backpack"], per=10)
    cfg = make_config(
        {"dataset": "office_home", "data_dir": str(tmp_path), "partition": "domain", "clients": 4}
        | {"domain_fraction": 0.4, "image_size": 8, "db": None}
    )
    data = build_federated(cfg)
    assert data.domains == ("art", "real_world") and data.client_domain.tolist() == [0, 0, 1, 1]
    argv = ["run", "--dataset", "office_home", "--data-dir", str(tmp_path), "--partition", "domain", "--clients", "4"]
    argv += ["--domain-fraction", "0.4", "--image-size", "8", "--rounds", "1", "--local-epochs", "1", "--model", "mlp"]
    assert main([*argv, "--out", str(tmp_path / "run"), "--no-db"]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "domain_acc/art" in summary and "domain_acc/real_world" in summary and "domain_acc_avg" in summary
    # pooled for the label partitions
    pooled = build_federated(
        make_config({"dataset": "office-home", "data_dir": str(tmp_path), "clients": 2, "db": None})
    )
    assert pooled.num_clients == 2 and pooled.in_channels == 3


def test_domainnet_uses_its_official_split_lists(tmp_path) -> None:
    root = _folders(tmp_path / "domainnet", ["clipart", "real"], ["apple", "zebra"], per=4)
    for d in ("clipart", "real"):
        files = sorted((root / d).rglob("*.png"))
        lines = [f"{p.relative_to(root).as_posix()} {0 if p.parent.name == 'apple' else 1}" for p in files]
        (root / f"{d}_train.txt").write_text("\n".join(lines[:-2]) + "\n")
        (root / f"{d}_test.txt").write_text("\n".join(lines[-2:]) + "\n")
    doms = suite_domains(_suite("domainnet"), tmp_path, 8)
    assert len(doms["clipart"].y_train) == 6 and doms["clipart"].y_test.tolist() == [1, 1]
    (root / "real_test.txt").write_text("real/lion/x.png 2\n")
    with pytest.raises(DataError, match=r"real_test.txt:1: expected 'domain/class/file label'"):
        suite_domains(_suite("domainnet"), tmp_path, 9)


def test_a_suite_needs_two_domains_and_says_where_it_looked(tmp_path) -> None:
    _folders(tmp_path / "PACS", ["photo"], ["dog"])
    with pytest.raises(DataError, match="needs at least 2 of its domain folders"):
        suite_domains(_suite("pacs"), tmp_path, 8)
    with pytest.raises(Exception, match="dataset 'domainnet' not found. Searched"):
        suite_domains(_suite("domainnet"), tmp_path / "nothing", 8)


@pytest.mark.parametrize(
    ("dataset", "root", "domains"),
    [("pacs", "PACS", ["cartoon", "photo"]), ("domainnet", "domainnet", ["painting", "sketch"])],
)
def test_each_suite_runs_under_domain_skew(tmp_path, capsys, dataset, root, domains) -> None:
    _folders(tmp_path / root, domains, ["a", "b"], per=10)
    argv = ["run", "--dataset", dataset, "--data-dir", str(tmp_path), "--partition", "domain", "--clients", "2"]
    argv += ["--domain-fraction", "0.5", "--image-size", "8", "--rounds", "1", "--local-epochs", "1", "--model", "mlp"]
    assert main([*argv, "--out", str(tmp_path / "run"), "--no-db"]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["domains"] == domains and all(f"domain_acc/{d}" in summary for d in domains)
