"""Every example in examples/ runs on small settings and prints what it promises."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(args: list[str], cwd: Path, extra_path: list[Path] = ()) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, extra_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_custom_data_and_model_example(tmp_path):
    out = _run([str(EXAMPLES / "custom_data_model.py"), "--rounds", "3"], tmp_path)
    accs = {m: float(a) for m, a in re.findall(r"^(\w+): final global accuracy ([\d.]+)$", out, re.M)}
    assert set(accs) == {"fedavg", "fedprox"}
    assert all(a > 0.4 for a in accs.values())  # 4 classes: chance is 0.25
    assert not (tmp_path / "runs").exists()  # the library API writes nothing unless asked


def test_custom_weighting_example_reports_every_method(tmp_path):
    out = _run([str(EXAMPLES / "custom_weighting.py"), "--rounds", "2", "--seeds", "2", "--db", "w.db"], tmp_path)
    rows = [line for line in out.splitlines() if line.startswith("| fed")]
    names = [r.split("|")[1].strip() for r in rows]
    assert sorted(names) == ["fedavg (weights=samples)", "fedavg (weights=uniform)", "fedprox+disco", "fedprox+invloss"]
    assert all("2 (0,1)" in r and "±" in r for r in rows)
    assert (tmp_path / "w.db").is_file()


def test_plugin_package_entry_point_works_from_the_cli(tmp_path):
    """The skeleton's declared entry points, installed as pip would (a dist-info with entry_points.txt on the path):
    `fedskew methods` lists its weighting and `fedskew run` composes it with FedProx, hyper-parameter included, on
    its partition scheme, with the scheme's parameter given by -P."""
    pkg = EXAMPLES / "plugin_package"
    meta = tomllib.loads((pkg / "pyproject.toml").read_text())
    eps = meta["project"]["entry-points"]["fedskew.methods"]
    site = tmp_path / "site"
    info = site / "fedskew_invloss-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['project']['name']}\nVersion: 0.1.0\n")
    parts = meta["project"]["entry-points"]["fedskew.partitions"]
    (info / "entry_points.txt").write_text(
        "[fedskew.methods]\n"
        + "".join(f"{k} = {v}\n" for k, v in eps.items())
        + "[fedskew.partitions]\n"
        + "".join(f"{k} = {v}\n" for k, v in parts.items())
    )
    paths = [site, pkg / "src"]
    listing = _run(["-m", "fedskew.cli", "methods"], tmp_path, paths)
    assert "invloss_pkg" in listing
    _run(
        [
            "-m",
            "fedskew.cli",
            "run",
            "--method",
            "fedprox+invloss_pkg",
            "-m",
            "power=2",
            "--partition",
            "shards_pkg",
            "-P",
            "per_client=3",
            "--rounds",
            "2",
            "--clients",
            "4",
            "--out",
            "r",
            "--no-db",
            "--quiet",
        ],
        tmp_path,
        paths,
    )
    cfg = (tmp_path / "r" / "config.yaml").read_text()
    assert "fedprox+invloss_pkg" in cfg and "power: 2" in cfg
    assert "partition: shards_pkg" in cfg and "per_client: 3" in cfg
    assert "shards_pkg" in _run(["-m", "fedskew.cli", "partition", "--list"], tmp_path, paths)


def test_one_file_method_example_runs_both_paths(tmp_path):
    out = _run([str(EXAMPLES / "one_file_method.py"), "--rounds", "2"], tmp_path)
    rows = re.findall(r"^([\w+]+): final global accuracy ([\d.]+); batched path within ([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["fedavg", "my_feddecorr", "my_feddecorr+disco"]
    assert float(rows[0][2]) == 0.0  # FedAvg: the batched path gives the sequential numbers
    assert all(float(acc) > 0.1 for _, acc, _ in rows)


def test_the_tutorial_runs_and_prints_its_three_parts(tmp_path):
    """examples/tutorial.py, the first-hour walk-through the docs point to (issue 45: a runnable tutorial CI runs)."""
    out = _run([str(EXAMPLES / "tutorial.py"), "--rounds", "2", "--seeds", "2"], tmp_path)
    assert len(re.findall(r"^   client \d+: +\d+ samples", out, re.M)) == 10
    rows = re.findall(r"^   (fedavg.*?|fedprox)\s+([\d.]+) ± +([\d.]+)\s+Δ\s+([+-][\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["fedavg", "fedavg, uniform weights (control)", "fedavg+disco", "fedprox"]
    assert rows[0][3] == "+0.00"  # FedAvg against itself
    personal = re.search(r"personal model \(generic \+ personal head\)\s+([\d.]+)", out)
    assert personal is not None and 0 < float(personal.group(1)) <= 100
    assert not (tmp_path / "runs").exists()  # the library API writes nothing unless asked
