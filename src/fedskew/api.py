"""fedskew as a library: your data, your model, your method, the same engine as the CLI.

Everything here is importable from ``fedskew`` itself::

    import fedskew

    data = fedskew.from_arrays(x, y)                           # one pool; fedskew partitions it (partition=, alpha=)
    data = fedskew.from_clients([(x0, y0), (x1, y1)], test=[(xt0, yt0), (xt1, yt1)])   # clients as given
    result = fedskew.run("fedprox+disco", data, model=my_net, rounds=20, clients=10, alpha=0.1, seed=0)
    result.records[-1]["global_acc"], result.summary["global_acc"]["last_n_mean"]

    @fedskew.weighting("invloss")                              # a new server weighting, composable by name
    def inverse_loss(rin, params):
        return 1.0 / rin.metrics["train_loss"]

    fedskew.run("fedprox+invloss", data, rounds=20)

``run`` takes every setting of ``fedskew run`` as a keyword (``rounds``, ``clients``, ``partition``, ``alpha``,
``lr``, ``local_epochs``, ``join_ratio``, ``seed``, ...; see ``fedskew run --help`` and
:class:`fedskew.config.RunConfig`) and returns the run's records (the lines of ``metrics.jsonl``) and its summary
(``summary.json``), the same content the CLI writes; ``out=DIR`` keeps the run directory, ``db=PATH`` records it in
a results database for ``fedskew report``. Data and settings are validated as for the CLI, with the same errors.

Extension points: :func:`weighting` and :func:`combine` turn a function into a server plug-in; :func:`register` adds
any :class:`ClientPart` (a :class:`LocalAlgorithm`'s hooks) or :class:`ServerPlugin` (weighting, masking, combine,
step or personalize roles). See docs/extending.md.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from pydantic import BaseModel
from torch import Tensor

from fedskew.client.local import LocalAlgorithm
from fedskew.data.federated import build_federated
from fedskew.data.partition.registry import partition
from fedskew.data.readers import ClientDatasets, ImageDataset
from fedskew.engine.loop import UserModel
from fedskew.models.custom import split_model
from fedskew.protocol import ClientReport, Params, RoundInput, State
from fedskew.registry import ClientPart, NoParams, ServerPlugin, register, unregister
from fedskew.schema import ConfigError
from fedskew.server.api import Combine, Weighting, stateless

__all__ = [
    "ClientPart",
    "LocalAlgorithm",
    "RunResult",
    "ServerPlugin",
    "combine",
    "from_arrays",
    "from_clients",
    "partition",
    "register",
    "run",
    "split_model",
    "unregister",
    "weighting",
]

ArrayLike = Any  # numpy array, torch tensor, or anything np.asarray takes


# ---- data -------------------------------------------------------------------------------------------------------


def _as_numpy(a: ArrayLike, what: str) -> np.ndarray:
    if isinstance(a, Tensor):
        return a.detach().cpu().numpy()
    try:
        return np.asarray(a)
    except Exception as exc:
        raise ConfigError(f"{what} cannot be read as an array: {exc}") from None


def dataset_arrays(dataset: Any, what: str = "dataset") -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` from a pair of arrays/tensors or from a map-style ``torch.utils.data.Dataset`` of ``(x, y)``
    items (read once, stacked)."""
    if isinstance(dataset, tuple | list) and len(dataset) == 2:
        return _as_numpy(dataset[0], f"{what} x"), _as_numpy(dataset[1], f"{what} y")
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        n = len(dataset)
        if n == 0:
            raise ConfigError(f"{what} is empty")
        xs, ys = [], []
        for i in range(n):
            item = dataset[i]
            if not (isinstance(item, tuple | list) and len(item) == 2):
                raise ConfigError(f"{what}[{i}] must be an (x, y) pair, got {type(item).__name__}")
            xs.append(_as_numpy(item[0], f"{what}[{i}] x"))
            ys.append(_as_numpy(item[1], f"{what}[{i}] y"))
        shapes = {x.shape for x in xs}
        if len(shapes) > 1:
            raise ConfigError(f"{what}: samples have different shapes {sorted(shapes)[:3]}")
        return np.stack(xs), np.stack(ys).reshape(n)
    raise ConfigError(f"{what} must be an (x, y) pair or a torch Dataset of (x, y) items, got {type(dataset).__name__}")


def _check_xy(x: np.ndarray, y: np.ndarray, what: str, num_classes: int | None) -> tuple[np.ndarray, np.ndarray]:
    if x.ndim < 2:
        raise ConfigError(f"{what}: x must be [N, ...] with at least one feature dimension, got shape {x.shape}")
    if y.ndim != 1 or len(y) != len(x):
        raise ConfigError(f"{what}: y must be [N] with one label per sample; got x {x.shape} and y {y.shape}")
    if len(x) == 0:
        raise ConfigError(f"{what} has no samples")
    if x.dtype != np.uint8 and not np.issubdtype(x.dtype, np.floating):
        raise ConfigError(f"{what}: x must be uint8 images (scaled to [-1, 1]) or floating-point, got {x.dtype}")
    if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
        raise ConfigError(f"{what}: x contains NaN or Inf")
    if np.issubdtype(y.dtype, np.floating):
        if not np.isfinite(y).all() or not np.all(y == np.round(y)):
            raise ConfigError(f"{what}: labels must be integers, got non-integer values")
    elif not np.issubdtype(y.dtype, np.integer):
        raise ConfigError(f"{what}: labels must be integers, got dtype {y.dtype}")
    y = y.astype(np.int64)
    if y.min() < 0 or (num_classes is not None and y.max() >= num_classes):
        raise ConfigError(f"{what}: labels must lie in [0, {num_classes}), got {int(y.min())}..{int(y.max())}")
    return x, y


def _label_kind(y: np.ndarray, what: str) -> None:
    """Labels are numbers: class names (strings, objects) are refused with the way to map them."""
    if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating) or y.dtype == np.bool_):
        raise ConfigError(
            f"{what}: labels must be integers 0 .. C-1, got dtype {y.dtype} (class names? map them first: "
            "names, y = np.unique(y, return_inverse=True))"
        )


def _num_classes(num_classes: int | None, labels: Sequence[np.ndarray]) -> int:
    k = int(max(int(y.max()) for y in labels if len(y))) + 1 if num_classes is None else num_classes
    if k < 2:
        raise ConfigError(f"a classification task needs at least 2 classes, got {k}")
    return k


def from_arrays(
    x: ArrayLike,
    y: ArrayLike,
    *,
    x_test: ArrayLike | None = None,
    y_test: ArrayLike | None = None,
    num_classes: int | None = None,
    name: str = "arrays",
) -> ImageDataset:
    """A pool of samples ``x`` ``[N, ...]`` with integer labels ``y`` ``[N]`` that ``run`` partitions among the
    clients (``partition``, ``alpha``, ``clients``, ... settings; per-client train/test split by ``train_ratio``).
    ``x_test``/``y_test``: the global test set (else a stratified ``holdout`` share of the pool). ``x`` may be uint8
    images ``[N, C, H, W]`` (scaled to [-1, 1] as the built-in datasets) or floating-point features of any shape
    (used as they are). Either argument may also be a torch ``Dataset``: ``from_arrays(*dataset_arrays(ds))``."""
    xs, ys = _as_numpy(x, "x"), _as_numpy(y, "y")
    _label_kind(ys, name)
    k = _num_classes(num_classes, [ys.astype(np.int64, copy=False)] if ys.size else [np.zeros(1, np.int64)])
    xs, ys = _check_xy(xs, ys, name, k)
    xt = yt = None
    if (x_test is None) != (y_test is None):
        raise ConfigError("give both x_test and y_test, or neither")
    if x_test is not None:
        xt, yt = _check_xy(_as_numpy(x_test, "x_test"), _as_numpy(y_test, "y_test"), f"{name} test", k)
        if xt.shape[1:] != xs.shape[1:]:
            raise ConfigError(f"{name}: test samples have shape {xt.shape[1:]}, training samples {xs.shape[1:]}")
    return ImageDataset(name, xs, ys, xt, yt, k)


def from_clients(
    train: Sequence[Any],
    *,
    test: Sequence[Any] | None = None,
    num_classes: int | None = None,
    name: str = "clients",
) -> ClientDatasets:
    """Clients as given (``partition: given``): ``train[k]`` is client k's ``(x, y)`` (arrays or tensors) or a
    torch ``Dataset``, ``test[k]`` its local test data (else each client's data is split with the run's
    ``train_ratio``, seeded by the run's seed). The global test set is the union of the clients' test splits."""
    if len(train) < 1:
        raise ConfigError("from_clients needs at least one client")
    pairs = [dataset_arrays(d, f"client {k}") for k, d in enumerate(train)]
    tests = [dataset_arrays(d, f"client {k} test") for k, d in enumerate(test)] if test is not None else None
    if tests is not None and len(tests) != len(pairs):
        raise ConfigError(f"test has {len(tests)} clients, train has {len(pairs)}")
    labels = [p[1] for p in pairs] + [t[1] for t in tests or []]
    for i, y in enumerate(labels):
        _label_kind(np.asarray(y), f"{name} part {i}")
    k = _num_classes(num_classes, [np.asarray(y).astype(np.int64) for y in labels])
    pairs = [_check_xy(x, y, f"{name} client {i}", k) for i, (x, y) in enumerate(pairs)]
    if tests is not None:
        tests = [_check_xy(x, y, f"{name} client {i} test", k) for i, (x, y) in enumerate(tests)]
    shape = pairs[0][0].shape[1:]
    for i, (x, _) in enumerate(pairs + (tests or [])):
        if x.shape[1:] != shape:
            raise ConfigError(f"{name}: sample shape {x.shape[1:]} (part {i}) differs from {shape}")
    return ClientDatasets(
        name,
        k,
        [x for x, _ in pairs],
        [y for _, y in pairs],
        [x for x, _ in tests] if tests is not None else None,
        [y for _, y in tests] if tests is not None else None,
        [f"client {i}" for i in range(len(pairs))],
    )


# ---- running ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunResult:
    """What ``run`` returns: the round records (``metrics.jsonl``), the summary (``summary.json``), the run's
    resolved configuration, and the run directory when one was kept (``out=``)."""

    run_id: str
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    config: dict[str, Any]
    run_dir: Path | None

    @property
    def diverged(self) -> bool:
        return bool(self.summary.get("diverged"))


def run(
    method: str = "fedavg",
    data: ImageDataset | ClientDatasets | str | None = None,
    *,
    model: UserModel | None = None,
    method_args: dict[str, Any] | None = None,
    out: str | Path | None = None,
    db: str | Path | None = None,
    overwrite: bool = False,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    **settings: Any,
) -> RunResult:
    """Run ``method`` (any registered composition) on ``data`` and return its records and summary.

    ``data``: :func:`from_arrays` / :func:`from_clients`, a built-in dataset name (``"mnist"``, with
    ``data_dir=``), or ``None`` for the embedded digits. ``model``: an ``nn.Module`` (its weights are the initial
    model) or a function returning one (seeded by the run's seed); the body/head split is declared
    (``.body``/``.head`` or :func:`split_model`) or inferred from the last ``nn.Linear``. ``None``: the model zoo's
    ``model=`` setting. ``settings``: any ``fedskew run`` setting (``rounds=20, clients=10, alpha=0.1, seed=0``).
    ``on_round(record)`` sees each round's record as it finishes."""
    from fedskew.config import make_config
    from fedskew.runner import run_experiment

    values: dict[str, Any] = {**settings, "method": method, "method_args": dict(method_args or {})}
    federation = None
    if isinstance(data, str):
        values["dataset"] = data
    elif isinstance(data, ImageDataset | ClientDatasets):
        values["dataset"] = data.name
    elif data is not None:
        raise ConfigError(
            f"data must come from fedskew.from_arrays / from_clients or be a dataset name, got {type(data).__name__}"
        )
    if isinstance(data, ClientDatasets):
        values["clients"] = data.num_clients
        values.setdefault("partition", "given")
    with tempfile.TemporaryDirectory(prefix="fedskew-run-") as tmp:
        values["out"] = str(out) if out is not None else str(Path(tmp) / "run")
        # no database unless asked (make_config ignores None overrides, so it goes in as a file value)
        cfg = make_config({"db": str(db) if db is not None else None}, values)
        if isinstance(data, ImageDataset | ClientDatasets):
            federation = build_federated(cfg, dataset=data)
        outcome = run_experiment(
            cfg,
            overwrite=overwrite,
            on_round=(lambda r: on_round(r.record)) if on_round is not None else None,
            data=federation,
            model=model,
        )
        config = yaml.safe_load((outcome.run_dir / "config.yaml").read_text())
    return RunResult(
        outcome.run_id, outcome.records, outcome.summary, config, outcome.run_dir if out is not None else None
    )


# ---- plug-ins from functions ------------------------------------------------------------------------------------


class _FunctionWeighting(Weighting):
    """A stateless weighting from ``fn(rin, params) -> [K]`` non-negative numbers (normalized here)."""

    def __init__(
        self, name: str, fn: Callable[[RoundInput, Any], Any], params: Any, reports: tuple[ClientReport, ...] = ()
    ) -> None:
        self.name, self.fn, self.params, self.reports = name, fn, params, reports

    def __call__(self, rin: RoundInput, masks: Params | None, state: State) -> tuple[Tensor, State]:
        w = torch.as_tensor(self.fn(rin, self.params), dtype=torch.float64).flatten().cpu()
        k = rin.num_participants
        if w.shape != (k,):
            raise ValueError(f"weighting {self.name!r} returned {tuple(w.shape)} weights for {k} participants")
        if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or float(w.sum()) <= 0:
            raise ValueError(f"weighting {self.name!r} returned weights {w.tolist()}: need finite, >= 0, sum > 0")
        return w / w.sum(), None


def _function_combine(name: str, fn: Callable[[RoundInput, Tensor, Any], Params], params: Any) -> Combine:
    """A stateless combine from ``fn(rin, weights, params) -> state dict`` (:func:`~fedskew.server.api.stateless`)."""

    def combine(rin: RoundInput, weights: Tensor, masks: Params | None) -> tuple[Params, dict[str, Any]]:
        if masks is not None:
            raise ValueError(f"combine {name!r} does not take element masks")
        out = fn(rin, weights, params)
        if not isinstance(out, dict):
            raise ValueError(f"combine {name!r} must return a state dict, got {type(out).__name__}")
        return out, {}

    return stateless(combine)


def _plugin_decorator(
    role: str,
    wrapper: Callable[..., Any],
    name: str,
    params: type[BaseModel],
    summary: str,
    paper: str,
    reports: tuple[ClientReport, ...] = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        doc = (fn.__doc__ or "").strip().splitlines()
        register(
            ServerPlugin(
                name,
                summary or (doc[0] if doc else f"user {role} {fn.__name__}"),
                paper or "user code",
                params,
                (role,),
                lambda p: {role: wrapper(name, fn, p, reports) if reports else wrapper(name, fn, p)},
            ),
            origin=f"user code ({fn.__module__}.{fn.__qualname__})",
        )
        return fn

    return decorate


def weighting(
    name: str,
    *,
    params: type[BaseModel] = NoParams,
    summary: str = "",
    paper: str = "",
    reports: tuple[ClientReport, ...] = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(rin, params) -> [K] non-negative weights`` as a server plug-in ``name`` filling the
    ``weighting`` role: ``fedprox+name`` then averages the participants' models with these weights (normalized to
    sum 1). ``rin`` is the round's :class:`~fedskew.protocol.RoundInput` (``num_samples``,
    ``metrics["train_loss"]``, ``deltas()``, ``reports``, ...); ``params`` an instance of ``params`` (a
    :class:`~fedskew.schema.StrictSettings` model; its fields are ``-m`` hyper-parameters). ``reports``: what it
    needs from every client before round 1 (:class:`~fedskew.protocol.ClientReport`; e.g.
    ``(fedskew.protocol.LABEL_HIST,)`` makes ``rin.label_hists`` the participants' label histograms; nothing else
    about a client's data reaches the server)."""
    return _plugin_decorator("weighting", _FunctionWeighting, name, params, summary, paper, reports)


def combine(
    name: str, *, params: type[BaseModel] = NoParams, summary: str = "", paper: str = ""
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(rin, weights, params) -> state dict`` as a server plug-in ``name`` filling the ``combine``
    role (how the stacked uploads ``rin.params[name]`` ``[K, ...]`` become the next global model)."""
    return _plugin_decorator("combine", _function_combine, name, params, summary, paper)
