"""Pack what the GPU run book needs beyond the device machine's own image, to travel with the working tree.

The device machines lent to this project (the workplace's ``nvidia-h200`` kind) run a Python 3.12 image with
PyTorch, numpy, scipy, scikit-learn and many common packages, but no network: fedskew's own dependency pydantic,
Flower and Ray (the ``vs-flower`` piece), and pfl-research (its ``pfl`` side) are not there. A call carries at most
64 MiB of working tree, and Ray's wheel alone is 79 MB. This installs the run book's requirements (fedskew's core
dependencies and its ``flower-sim`` and ``pfl`` extras, read from ``pyproject.toml``) for the device's Python and
platform into a staging folder with ``pip install --target``, removes what the image already has
(:data:`FROM_IMAGE`, each removed by its own RECORD) and what the run book never loads (:data:`TRIM`: Ray's Java
jar, source maps, uv's binary), and writes one ``site.tar.xz`` with a manifest::

    python tools/device_bundle.py --out .devicepkgs        # here, where pip reaches the package index
    # then on the device (tools/device_run.sh does this): tar xJf .devicepkgs/site.tar.xz -C /tmp/site

``--python 3.11`` builds the same bundle for this machine's Python, which is how it is checked without a device:
a fresh virtual environment holding only the image's packages, the bundle on ``PYTHONPATH``, and the run book's
smoke pieces (docs/design.md, "The run book on a lent device"). It exits 1 when the bundle is larger than
``--limit-mib`` (what a call may carry beside the working tree and the data).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("flower-sim", "pfl")
# Distributions the device image holds (its package list as read on 2026-11-17,
# /work/.library/device/KINDS.md) and that the run book takes from it: the large compiled ones (numpy, scipy, torch),
# and small pure ones whose every version since years suits the carried packages. Version-sensitive ones are
# carried even where the image has them: protobuf and grpcio (Flower's generated code checks their versions at
# import), pydantic (fedskew's configs), Ray, Flower, pfl and the libraries they pin.
FROM_IMAGE = frozenset(
    {
        "absl-py",
        "annotated-doc",
        "anyio",
        "attrs",
        "certifi",
        "charset-normalizer",
        "click",
        "cloudpickle",
        "filelock",
        "fsspec",
        "h11",
        "httpcore",
        "httpx",
        "idna",
        "jinja2",
        "markdown-it-py",
        "markupsafe",
        "mdurl",
        "mpmath",
        "msgpack",
        "numpy",
        "packaging",
        "pathspec",
        "pygments",
        "pyyaml",
        "requests",
        "rich",
        "scipy",
        "setuptools",
        "shellingham",
        "six",
        "sympy",
        "networkx",
        "typer",
        "typing-extensions",
        "urllib3",
        "uv",
        "uvloop",
        "wheel",
        "wrapt",
        "scikit-learn",
        "joblib",
        "threadpoolctl",
        "matplotlib",
        "contourpy",
        "cycler",
        "fonttools",
        "kiwisolver",
        "pillow",
        "pyparsing",
        "python-dateutil",
    }
)
# never loaded by the run book: console scripts (uv's binary alone is 38 MB; the run book imports modules), Ray's
# Java worker jar (32 MB of its 79 MB wheel), its libraries above the core (RLlib, Data, Serve, Tune, Train, LLM:
# imported on first use only, and Flower's simulation uses none), the dashboard's web front end and source maps
TRIM = (
    "bin",
    "ray/jars",
    "ray/rllib",
    "ray/data",
    "ray/serve",
    "ray/tune",
    "ray/train",
    "ray/llm",
    "ray/dashboard/client/build",
    "*.js.map",
)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(pyproject: Path = ROOT / "pyproject.toml", extras: tuple[str, ...] = EXTRAS) -> list[str]:
    """fedskew's core dependencies and the given extras' (torch left to the image), from ``pyproject.toml``."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        if extra not in project["optional-dependencies"]:
            raise SystemExit(f"pyproject.toml has no extra {extra!r}")
        reqs += project["optional-dependencies"][extra]
    out: list[str] = []
    for r in reqs:
        if normalize(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) != "torch" and r not in out:
            out.append(r)
    return out


def dist_name(dist_info: Path) -> str:
    """The distribution's normalized name from its METADATA (a dist-info folder's name may be escaped)."""
    for line in (dist_info / "METADATA").read_text(errors="replace").splitlines():
        if line.startswith("Name:"):
            return normalize(line.split(":", 1)[1].strip())
    raise SystemExit(f"{dist_info} has no Name in its METADATA")


def remove_dist(stage: Path, dist_info: Path) -> int:
    """Delete every file the distribution's RECORD lists inside ``stage`` (and then empty folders); bytes freed."""
    freed = 0
    record = dist_info / "RECORD"
    paths = (
        [line.rsplit(",", 2)[0] for line in record.read_text().splitlines() if line.strip()] if record.exists() else []
    )
    for rel in paths:
        p = (stage / rel).resolve()
        if stage.resolve() in p.parents and p.is_file():
            freed += p.stat().st_size
            p.unlink()
    if dist_info.exists():
        shutil.rmtree(dist_info)
    for d in sorted((p for p in stage.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(d.iterdir()):
            d.rmdir()
    return freed


def prune(stage: Path, from_image: frozenset[str] = FROM_IMAGE, trim: tuple[str, ...] = TRIM) -> dict[str, list[str]]:
    """Remove the image's distributions and the trimmed paths from ``stage``; what was carried and left out."""
    carried, left = [], []
    for info in sorted(stage.glob("*.dist-info")):
        name = dist_name(info)
        version = info.name[: -len(".dist-info")].rsplit("-", 1)[-1]
        if name in from_image:
            remove_dist(stage, info)
            left.append(f"{name} {version}")
        else:
            carried.append(f"{name} {version}")
    trimmed = []
    for pattern in trim:
        for p in sorted(stage.glob(pattern) if "*" not in pattern else stage.rglob(pattern)):
            trimmed.append(str(p.relative_to(stage)))
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    for cache in list(stage.rglob("__pycache__")):
        shutil.rmtree(cache, ignore_errors=True)
    return {
        "carried": sorted(carried),
        "from_image": sorted(left),
        "trimmed": trimmed,
        "stripped": strip_symbols(stage),
    }


def strip_symbols(stage: Path) -> int:
    """Drop the symbol tables of the compiled files (Ray's are shipped unstripped); bytes saved, 0 without ``strip``.

    ``strip --strip-unneeded`` keeps what dynamic linking needs; a file it refuses is kept as it was."""
    tool = shutil.which("strip")
    if tool is None:
        return 0
    saved = 0
    for f in stage.rglob("*"):
        if f.is_file() and not f.is_symlink():
            with f.open("rb") as fh:
                if fh.read(4) != b"\x7fELF":
                    continue
            before = f.stat().st_size
            if subprocess.run([tool, "--strip-unneeded", str(f)], capture_output=True, check=False).returncode == 0:
                saved += before - f.stat().st_size
    return saved


def install(reqs: list[str], stage: Path, python: str) -> None:
    major, minor = python.split(".")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-compile",
        "--target",
        str(stage),
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        "--abi",
        f"cp{major}{minor}",
    ]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run([*cmd, *reqs], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / ".devicepkgs", help="folder for site.tar.xz and MANIFEST.json")
    p.add_argument("--python", default="3.12", help="the device's Python (3.12 on nvidia-h200)")
    p.add_argument(
        "--extras",
        default=",".join(EXTRAS),
        help="fedskew extras to carry besides its core dependencies ('' for the core alone, about 2.5 MiB: room for "
        "FMNIST and USPS beside MNIST in a call that runs no peer)",
    )
    p.add_argument(
        "--data",
        type=Path,
        action="append",
        default=[],
        help="a dataset folder to copy into OUT/data/<its name> (e.g. ../shared/data/mnist); repeatable",
    )
    p.add_argument(
        "--limit-mib",
        type=float,
        default=59.0,
        help="the most OUT may hold: what a call carries (64 MiB) less the working tree (about 4 MiB)",
    )
    args = p.parse_args(argv)
    for src in args.data:
        if not src.is_dir():
            raise SystemExit(f"--data {src}: no such folder")
    reqs = requirements(extras=tuple(x for x in args.extras.split(",") if x))
    with tempfile.TemporaryDirectory(prefix="fedskew-bundle-") as tmp:
        stage = Path(tmp) / "site"
        install(reqs, stage, args.python)
        manifest = prune(stage)
        args.out.mkdir(parents=True, exist_ok=True)
        archive = args.out / "site.tar.xz"
        partial = archive.with_suffix(".xz.partial")
        with tarfile.open(partial, "w:xz", preset=6) as tar:
            for child in sorted(stage.iterdir()):
                tar.add(child, arcname=child.name)
        partial.replace(archive)
    for src in args.data:
        shutil.copytree(src, args.out / "data" / src.name, copy_function=shutil.copyfile, dirs_exist_ok=True)
    size_mib = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file()) / 2**20
    manifest = {
        "python": args.python,
        "requirements": reqs,
        "data": sorted(d.name for d in args.data),
        "bundle_mib": round(archive.stat().st_size / 2**20, 2),
        "size_mib": round(size_mib, 2),
        **manifest,
    }
    (args.out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(
        f"{args.out}: {size_mib:.1f} MiB ({manifest['bundle_mib']} MiB of packages), "
        f"{len(manifest['carried'])} distributions carried, "
        f"{len(manifest['from_image'])} left to the image, {len(manifest['trimmed'])} paths trimmed"
    )
    if size_mib > args.limit_mib:
        print(f"error: {args.out} holds {size_mib:.1f} MiB, over --limit-mib {args.limit_mib}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
