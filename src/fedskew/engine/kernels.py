"""The GPU kernel choices a run may set: TensorFloat-32 and cuDNN's benchmark mode (the ``tf32`` and
``cudnn_benchmark`` settings).

Both are process-wide PyTorch flags (``torch.backends.cudnn.allow_tf32``, ``torch.backends.cuda.matmul.allow_tf32``,
``torch.backends.cudnn.benchmark``) that only a CUDA device reads. torch's defaults: TF32 in cuDNN's convolutions, not
in matmuls, and no benchmark mode. So with the defaults the grouped form of the stacked convolutions runs in TF32 while
their unfolded form (a batched matmul, ``stacked_conv: unfold``) runs in full float32: comparing the two forms fairly
needs ``tf32: on`` (or ``off``). A run sets the flags for its duration (:func:`device_kernels`) and puts back what it
found; runs of one process at once (stacked seeds, each in its own thread) share the flags, so they must ask for the
same. The flags in force are recorded with the run's arithmetic (:func:`fedskew.engine.numerics.numerics`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fedskew.schema import ConfigError

Flags = tuple[bool, bool, bool]  # TF32 in cuDNN's convolutions, TF32 in matmuls, cuDNN's benchmark mode
TF32_MODES = ("torch", "on", "off")


@dataclass
class _Held:
    """The runs of this process holding flags: how many, the flags they hold, and those found before the first."""

    count: int = 0
    flags: Flags = (False, False, False)
    before: Flags = (False, False, False)


_LOCK = threading.Lock()
_HELD = _Held()


def current() -> Flags:
    """The flags in force in this process."""
    b = torch.backends
    return bool(b.cudnn.allow_tf32), bool(b.cuda.matmul.allow_tf32), bool(b.cudnn.benchmark)


def _apply(flags: Flags) -> None:
    b = torch.backends
    b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32, b.cudnn.benchmark = flags


def wanted(tf32: str, cudnn_benchmark: bool, now: Flags) -> Flags:
    """The flags a run asks for, from those in force: ``tf32`` ``torch`` keeps both TF32 flags as they are, ``on`` /
    ``off`` sets both; ``cudnn_benchmark`` true turns benchmark mode on, false leaves it as it is."""
    if tf32 not in TF32_MODES:
        raise ConfigError(f"tf32 must be one of {', '.join(TF32_MODES)}, not {tf32!r}")
    conv, matmul = (now[0], now[1]) if tf32 == "torch" else (tf32 == "on", tf32 == "on")
    return conv, matmul, now[2] or bool(cudnn_benchmark)


def ignored(device: str, tf32: str, cudnn_benchmark: bool) -> str:
    """The note for a run off CUDA that sets either (``""`` when it sets neither, or runs on CUDA)."""
    if str(device).startswith("cuda"):
        return ""
    asked = [f"tf32 {tf32}"] if tf32 != "torch" else []
    asked += ["cudnn_benchmark"] if cudnn_benchmark else []
    if not asked:
        return ""
    return f"{' and '.join(asked)}: CUDA settings (TF32, cuDNN); this {device} run computes without them"


def set_kernels(device: str, tf32: str = "torch", cudnn_benchmark: bool = False) -> str:
    """Set the flags for the rest of this process (a Flower node or server app, whose process runs one
    configuration); returns :func:`ignored`'s note."""
    note = ignored(device, tf32, cudnn_benchmark)
    if str(device).startswith("cuda"):
        _apply(wanted(tf32, cudnn_benchmark, current()))
    return note


@contextmanager
def device_kernels(device: str, tf32: str = "torch", cudnn_benchmark: bool = False) -> Iterator[str]:
    """Hold the flags a run on ``device`` asks for while it runs, then put back those found (when the last run of
    this process holding them ends). Yields :func:`ignored`'s note. A run asking for other flags than a run of this
    process already holds is refused: the flags are the process's, so one of them would run on the other's."""
    note = ignored(device, tf32, cudnn_benchmark)
    if not str(device).startswith("cuda"):
        yield note
        return
    with _LOCK:
        if _HELD.count:
            flags = wanted(tf32, cudnn_benchmark, _HELD.before)
            if flags != _HELD.flags:
                raise ConfigError(
                    f"this run asks for GPU kernel flags {_describe(flags)}, but a run of this process already holds "
                    f"{_describe(_HELD.flags)} (tf32 / cudnn_benchmark are process-wide): give the runs the same "
                    "settings, or run them in separate processes"
                )
        else:
            _HELD.before = current()
            _HELD.flags = wanted(tf32, cudnn_benchmark, _HELD.before)
            _apply(_HELD.flags)
        _HELD.count += 1
    try:
        yield note
    finally:
        with _LOCK:
            _HELD.count -= 1
            if not _HELD.count:
                _apply(_HELD.before)


def _describe(flags: Flags) -> str:
    conv, matmul, bench = flags
    return f"(TF32 convolutions {'on' if conv else 'off'}, matmuls {'on' if matmul else 'off'}, benchmark {bench})"


def describe(flags: Flags | None = None) -> dict[str, str]:
    """The flags as the run's arithmetic record writes them."""
    conv, matmul, bench = flags or current()
    on = lambda b: "on" if b else "off"  # noqa: E731
    return {"tf32": f"convolutions {on(conv)}, matmuls {on(matmul)}", "cudnn_benchmark": on(bench)}


__all__ = ["TF32_MODES", "current", "describe", "device_kernels", "ignored", "set_kernels", "wanted"]
