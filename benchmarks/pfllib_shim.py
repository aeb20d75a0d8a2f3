"""Run an unmodified PFLlib script where torchvision cannot be installed (as with the CPU torch build here).

PFLlib's FedAvg path (``system/main.py -algo FedAvg -m CNN``) never calls torchvision, cvxpy or calmsize, but
``main.py`` imports them at the top (for other models and methods). This shim stands in for those modules *only when
they cannot be imported*: any use of a stand-in raises, so a run that needed one fails loudly instead of measuring
something else. For ``dataset/generate_MNIST.py`` it also provides the two torchvision pieces that script uses,
``datasets.MNIST`` (read from the official IDX files in ``--mnist-idx`` by fedskew's reader, instead of downloading)
and ``transforms.{Compose, ToTensor, Normalize}`` (same arithmetic: ``x/255``, then ``(x - mean) / std``), so PFLlib's
own generator, seeds and splitting code write its dataset folder.

    python benchmarks/pfllib_shim.py --mnist-idx ../shared/data/mnist -- generate_MNIST.py noniid - dir   # in dataset/
    python benchmarks/pfllib_shim.py -- main.py -data MNIST -m CNN -algo FedAvg ...                       # in system/

PFLlib seeds torch with 0 and nothing else (``torch.manual_seed(0)`` in ``main.py`` and in every client's
constructor), so each of its runs is the same draw. ``--torch-seed S`` makes those calls seed ``S`` (every
``torch.manual_seed(0)`` becomes ``torch.manual_seed(S)``; other seeds pass through; 0 leaves the run as it is), so
PFLlib's own spread over seeds can be measured beside fedskew's. This is the only change to PFLlib's behaviour
unless ``--host-seed`` is given.

PFLlib does not seed Python's ``random`` or NumPy's global generator, and its ``select_clients`` draws the clients'
order with ``np.random.choice`` every round; as all clients draw their loaders' shuffles from the one torch generator,
that order decides which client gets which shuffles, so two runs at the same torch seed differ (its pFedMe on its
MNIST split: 56.97 and 58.14 at torch seed 0). ``--host-seed S`` seeds ``random`` and ``numpy.random`` with ``S``
before the script, so that a PFLlib figure can be measured again exactly.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import runpy
import sys
import types
from pathlib import Path
from typing import Any

STAND_INS = ("torchvision", "cvxpy", "calmsize")


class _Missing:
    """What any attribute of a stand-in module is: using it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Missing:
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is a stand-in (pfllib_shim.py): this PFLlib run needs the real package")


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _mnist_pieces(torchvision: types.ModuleType, idx_dir: Path) -> None:
    """``torchvision.datasets.MNIST`` from local IDX files and the three transforms generate_MNIST.py uses."""
    import torch

    from fedskew.data.readers.idx import load_mnist_like  # fedskew's own checked IDX reader

    mnist = load_mnist_like("mnist", idx_dir)

    class MNIST:
        def __init__(self, root: str, train: bool = True, download: bool = False, transform: Any = None) -> None:
            images, labels = (mnist.x_train, mnist.y_train) if train else (mnist.x_test, mnist.y_test)
            self.data = torch.from_numpy(images.reshape(-1, 28, 28).copy())
            self.targets = torch.from_numpy(labels)
            self.transform = transform

        def __len__(self) -> int:
            return len(self.targets)

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            img = self.data[i]
            return (self.transform(img) if self.transform else img), self.targets[i]

    class Compose:
        def __init__(self, steps: list[Any]) -> None:
            self.steps = steps

        def __call__(self, x: Any) -> Any:
            for step in self.steps:
                x = step(x)
            return x

    class ToTensor:
        def __call__(self, img: Any) -> Any:  # uint8 [H, W] -> float [1, H, W] in [0, 1], as torchvision's
            return img.to(torch.float32).div(255).unsqueeze(0)

    class Normalize:
        def __init__(self, mean: list[float], std: list[float]) -> None:
            self.mean = torch.tensor(mean).view(-1, 1, 1)
            self.std = torch.tensor(std).view(-1, 1, 1)

        def __call__(self, x: Any) -> Any:
            return (x - self.mean) / self.std

    datasets = types.ModuleType("torchvision.datasets")
    datasets.MNIST = MNIST  # type: ignore[attr-defined]
    transforms = types.ModuleType("torchvision.transforms")
    transforms.Compose, transforms.ToTensor, transforms.Normalize = Compose, ToTensor, Normalize  # type: ignore
    sys.modules["torchvision.datasets"] = datasets
    sys.modules["torchvision.transforms"] = transforms
    torchvision.datasets, torchvision.transforms = datasets, transforms  # type: ignore[attr-defined]


def install(mnist_idx: Path | None) -> list[str]:
    """Stand in for the modules of ``STAND_INS`` that cannot be imported; return their names."""
    missing = {name for name in STAND_INS if importlib.util.find_spec(name) is None}
    if missing:
        sys.meta_path.append(_StandInFinder(missing))
    if "torchvision" in missing and mnist_idx is not None:
        import torchvision  # the stand-in

        _mnist_pieces(torchvision, mnist_idx)
    return sorted(missing)


def reseed_torch(seed: int) -> None:
    """Make PFLlib's ``torch.manual_seed(0)`` calls seed ``seed`` (module docstring)."""
    if seed == 0:
        return
    import torch

    original = torch.manual_seed

    def manual_seed(s: int) -> Any:
        return original(seed if int(s) == 0 else s)

    torch.manual_seed = manual_seed  # type: ignore[assignment]


def seed_host(seed: int | None) -> None:
    """Seed Python's and NumPy's global generators, which PFLlib leaves unseeded (module docstring)."""
    if seed is None:
        return
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mnist-idx", type=Path, help="folder of the official MNIST IDX files (for generate_MNIST.py)")
    p.add_argument("--torch-seed", type=int, default=0, help="the seed of PFLlib's torch.manual_seed(0) calls")
    p.add_argument(
        "--host-seed", type=int, help="seed Python's random and NumPy's global generator (PFLlib leaves them unseeded)"
    )
    p.add_argument("script", help="the PFLlib script, run from the current directory")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    stood_in = install(a.mnist_idx)
    if stood_in:
        print(f"pfllib_shim: stand-ins for {', '.join(stood_in)} (not installed)", file=sys.stderr)
    reseed_torch(a.torch_seed)
    seed_host(a.host_seed)
    sys.argv = [a.script, *a.args]
    sys.path.insert(0, str(Path(a.script).resolve().parent))
    runpy.run_path(a.script, run_name="__main__")


if __name__ == "__main__":
    main()
