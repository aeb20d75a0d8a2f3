"""The documentation site (issue 45): ``mkdocs build --strict`` turns docs/ into the site, every link between its
pages and every anchor checked, and the API reference generated from the docstrings."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra (mkdocs, mkdocs-material, mkdocstrings) is not installed")
pytest.importorskip("mkdocstrings", reason="the docs extra (mkdocstrings) is not installed")

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strictly_with_its_api_reference(tmp_path):
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("from_arrays", "LocalAlgorithm", "ServerHalf", "RunConfig", "calibrate"):
        assert name in api, f"the API reference lacks {name}"
    assert (site / "privacy" / "index.html").is_file() and (site / "methods" / "index.html").is_file()
