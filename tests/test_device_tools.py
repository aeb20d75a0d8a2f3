"""tools/device_bundle.py (what the GPU run book carries to a device without network) and tools/device_run.sh (the run
book as one device call), offline: the requirements it resolves, what it prunes, and the call's files and resume."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import device_bundle as db  # noqa: E402


def test_requirements_are_the_core_and_the_run_books_extras_without_torch(tmp_path: Path) -> None:
    reqs = db.requirements()
    names = {db.normalize(r.split(">")[0].split("=")[0].split("<")[0]) for r in reqs}
    assert {"pydantic", "flwr", "ray", "pfl", "numpy"} <= names
    assert "torch" not in names
    assert len(reqs) == len(set(reqs))
    fake = tmp_path / "pyproject.toml"
    fake.write_text(
        '[project]\nname = "x"\ndependencies = ["torch>=2.2", "pyyaml>=6"]\n'
        '[project.optional-dependencies]\nflower-sim = ["flwr>=1.41", "pyyaml>=6"]\npfl = ["pfl>=0.6"]\n'
    )
    assert db.requirements(fake) == ["pyyaml>=6", "flwr>=1.41", "pfl>=0.6"]
    assert db.requirements(fake, ()) == ["pyyaml>=6"]  # --extras '': the core alone
    with pytest.raises(SystemExit, match="no extra 'gpu'"):
        db.requirements(fake, ("gpu",))


def _dist(stage: Path, name: str, version: str, files: dict[str, str]) -> None:
    info = stage / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    rows = []
    for rel, text in files.items():
        path = stage / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        rows.append(f"{rel},sha256=x,{len(text)}")
    rows += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,", "../outside.txt,,"]
    (info / "RECORD").write_text("\n".join(rows) + "\n")


def test_prune_removes_the_images_distributions_and_the_trimmed_paths_only(tmp_path: Path) -> None:
    stage = tmp_path / "site"
    outside = tmp_path / "outside.txt"  # a RECORD may name paths outside the stage: they are never touched
    outside.write_text("keep")
    _dist(stage, "numpy", "2.5.5", {"numpy/__init__.py": "x", "numpy/core/_m.so": "y"})
    _dist(stage, "Typing_Extensions", "4.16.0", {"typing_extensions.py": "z"})  # the name normalized
    _dist(stage, "flwr", "1.42.0", {"flwr/__init__.py": "f", "flwr/ui/app.js.map": "map"})
    _dist(stage, "ray", "2.60.0", {"ray/__init__.py": "r", "ray/jars/ray_dist.jar": "j", "ray/rllib/a.py": "a"})
    (stage / "bin").mkdir()
    (stage / "bin" / "uv").write_text("binary")
    (stage / "flwr" / "__pycache__").mkdir()
    (stage / "flwr" / "__pycache__" / "x.pyc").write_text("c")
    found = db.prune(stage)
    assert found["carried"] == ["flwr 1.42.0", "ray 2.60.0"]
    assert found["from_image"] == ["numpy 2.5.5", "typing-extensions 4.16.0"]
    assert sorted(found["trimmed"]) == ["bin", "flwr/ui/app.js.map", "ray/jars", "ray/rllib"]
    left = sorted(str(p.relative_to(stage)) for p in stage.rglob("*") if p.is_file())
    assert left == [
        "flwr-1.42.0.dist-info/METADATA",
        "flwr-1.42.0.dist-info/RECORD",
        "flwr/__init__.py",
        "ray-2.60.0.dist-info/METADATA",
        "ray-2.60.0.dist-info/RECORD",
        "ray/__init__.py",
    ]
    assert not (stage / "numpy").exists() and outside.read_text() == "keep"


def test_strip_symbols_keeps_what_is_not_elf_and_shrinks_an_unstripped_library(tmp_path: Path) -> None:
    stage = tmp_path / "site"
    stage.mkdir()
    (stage / "a.py").write_text("print(1)\n")
    assert db.strip_symbols(stage) == 0 and (stage / "a.py").read_text() == "print(1)\n"
    if shutil.which("strip") is None:
        pytest.skip("no `strip` on this machine: the bundle is built without stripping")
    import yaml  # any compiled extension of the environment, copied (never the installed file)

    so = next((p for p in Path(yaml.__file__).parent.glob("*.so")), None) or next(
        (p for p in Path(json.__file__).parent.parent.glob("lib-dynload/*.so")), None
    )
    if so is None:
        pytest.skip("no compiled extension found to copy")
    copy = stage / "ext.so"
    shutil.copyfile(so, copy)
    before = copy.stat().st_size
    saved = db.strip_symbols(stage)
    assert saved == before - copy.stat().st_size >= 0
    assert copy.read_bytes()[:4] == b"\x7fELF"


def test_bundle_cli_refuses_a_missing_data_folder_before_any_install(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no such folder"):
        db.main(["--out", str(tmp_path / "pkgs"), "--data", str(tmp_path / "absent")])
    assert not (tmp_path / "pkgs").exists()


def _device_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "RESULTS": str(tmp_path / "results" / "gpu-suite"),
        "PKGS": str(tmp_path / "pkgs"),
        "SITE": str(tmp_path / "site"),
        "PYTHON": sys.executable,
        "BUDGET": "120",
    }
    return subprocess.run(
        ["bash", str(ROOT / "tools" / "device_run.sh"), *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_device_run_unpacks_the_bundle_runs_the_suite_and_packs_what_comes_back(tmp_path: Path) -> None:
    pkgs = tmp_path / "pkgs"
    pkgs.mkdir()
    with tarfile.open(pkgs / "site.tar.xz", "w:xz") as tar:  # a bundle holding one module
        data = b"VALUE = 42\n"
        info = tarfile.TarInfo("fedskew_bundle_probe.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    first = _device_run(tmp_path, "--smoke", "--only", "env")
    assert first.returncode == 0, first.stdout + first.stderr
    assert (tmp_path / "site" / "fedskew_bundle_probe.py").read_text() == "VALUE = 42\n"
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["gpu-suite.tgz", "imports.txt", "log.txt", "suite.md"]
    imports = (out / "imports.txt").read_text().splitlines()
    assert imports[0].startswith("torch ") and imports[1].startswith("fedskew ")
    assert [line.split()[0] for line in imports] == ["torch", "fedskew", "pydantic", "flwr", "ray", "pfl"]
    assert "env: ok" in (out / "log.txt").read_text()
    with tarfile.open(out / "gpu-suite.tgz") as tar:
        env = json.load(tar.extractfile("gpu-suite/env.json"))  # type: ignore[arg-type]
    assert env["ok"] and env["fedskew"]
    # the next call continues: the finished piece is skipped, the results stay where they were
    second = _device_run(tmp_path, "--smoke", "--only", "env")
    assert second.returncode == 0 and "env: done earlier, skipped" in second.stdout


def test_device_run_fails_naming_a_bundle_it_cannot_unpack(tmp_path: Path) -> None:
    (tmp_path / "pkgs").mkdir()
    (tmp_path / "pkgs" / "site.tar.xz").write_bytes(b"not an archive")
    done = _device_run(tmp_path, "--smoke", "--only", "env")
    assert done.returncode == 2 and "could not unpack" in done.stderr
