"""benchmarks/pfllib_shim.py: stand-ins only for packages that are missing, loud when used, and an MNIST stand-in
that gives torchvision's arithmetic on the official IDX files (read here from tiny files the test writes)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_readers import write_mnist

SHIM = Path(__file__).resolve().parents[1] / "benchmarks" / "pfllib_shim.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed: no stand-in"
)


def _run(tmp_path, script: str, *shim_args: str) -> subprocess.CompletedProcess:
    (tmp_path / "probe.py").write_text(script)
    return subprocess.run(
        [sys.executable, str(SHIM), *shim_args, "probe.py", "an-arg"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_stand_ins_import_but_raise_when_used(tmp_path):
    script = (
        "import sys, json, numpy, cvxpy\n"
        "from torchvision.models import resnet18\n"
        "out = {'argv': sys.argv[1:], 'numpy_real': hasattr(numpy, 'ndarray')}\n"
        "try:\n    resnet18(num_classes=10)\nexcept RuntimeError as e:\n    out['error'] = str(e)\n"
        "print(json.dumps(out))\n"
    )
    r = _run(tmp_path, script)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["argv"] == ["an-arg"] and out["numpy_real"]
    assert "torchvision.models.resnet18 is a stand-in" in out["error"]
    assert "stand-ins for" in r.stderr and "torchvision" in r.stderr


def test_mnist_stand_in_reads_idx_files_with_torchvisions_arithmetic(tmp_path):
    arrays = write_mnist(tmp_path / "mnist", n_train=6, n_test=3)
    script = (
        "import json, torchvision, torchvision.transforms as T\n"
        "t = T.Compose([T.ToTensor(), T.Normalize([0.5], [0.5])])\n"
        "tr = torchvision.datasets.MNIST(root='x', train=True, download=True, transform=t)\n"
        "te = torchvision.datasets.MNIST(root='x', train=False, download=True, transform=t)\n"
        "x, y = tr[4]\n"
        "print(json.dumps({'n': [len(tr), len(te)], 'shape': list(x.shape), 'y': int(y), 'x': x[0, 3, :5].tolist()}))\n"
    )
    r = _run(tmp_path, script, "--mnist-idx", str(tmp_path / "mnist"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["n"] == [6, 3] and out["shape"] == [1, 28, 28]
    assert out["y"] == int(arrays["train-labels-idx1-ubyte"][4])
    expected = (arrays["train-images-idx3-ubyte"][4, 3, :5] / 255.0 - 0.5) / 0.5
    assert out["x"] == pytest.approx(expected.tolist(), abs=1e-6)


def test_torch_seed_replaces_pfllibs_seed_zero_only(tmp_path):
    script = (
        "import json, torch\n"
        "torch.manual_seed(0); a = torch.rand(3).tolist()\n"  # PFLlib's calls: seed 0
        "torch.manual_seed(5); b = torch.rand(3).tolist()\n"  # any other seed passes through
        "print(json.dumps({'a': a, 'b': b}))\n"
    )
    runs = {}
    for seed in ("0", "7"):
        r = _run(tmp_path, script, "--torch-seed", seed)
        assert r.returncode == 0, r.stderr
        runs[seed] = json.loads(r.stdout.strip().splitlines()[-1])
    import torch

    torch.manual_seed(0)
    zero = torch.rand(3).tolist()
    torch.manual_seed(7)
    seven = torch.rand(3).tolist()
    torch.manual_seed(5)
    five = torch.rand(3).tolist()
    assert runs["0"] == {"a": zero, "b": five}  # 0: PFLlib's run as it is
    assert runs["7"] == {"a": seven, "b": five}


def test_host_seed_seeds_python_and_numpy_which_pfllib_leaves_unseeded(tmp_path):
    script = (
        "import json, random, numpy as np\n"
        "print(json.dumps({'np': np.random.choice(1000, 3, replace=False).tolist(), 'py': random.random()}))\n"
    )
    outs = []
    for _ in range(2):
        r = _run(tmp_path, script, "--host-seed", "3")
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    import random

    import numpy as np

    random.seed(3)
    np.random.seed(3)
    expected = {"np": np.random.choice(1000, 3, replace=False).tolist(), "py": random.random()}
    assert outs[0] == outs[1] == expected
