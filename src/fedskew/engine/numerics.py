"""Which arithmetic produced a run's numbers, recorded beside them.

A run repeats bit for bit on the same kind of machine (one seed drives everything: ``fedskew/seeding.py``). Across
machines it need not: three libraries inside PyTorch each choose their CPU code by the processor they find, and code
of another vector width sums in another order. ATen's own kernels (reductions, softmax, elementwise maths) go by
``torch.backends.cpu.get_cpu_capability()`` (``AVX2``, ``AVX512``, ...); the matrix products of linear layers go
through MKL, which also goes by the processor's vendor; convolutions go through oneDNN. Measured on one Intel Xeon
with AVX-512 (docs/guide.md, "Reproducibility"): the default digits run's round-1 training loss changes with each of
``ATEN_CPU_CAPABILITY``, ``MKL_CBWR`` and (for a CNN) ``ONEDNN_MAX_CPU_ISA`` alone, and with all three pinned to AVX2
it is still not the AMD AVX2 machine's number. Twenty rounds of training grow such differences into accuracies that
differ in the first decimal.

So the record names torch's version, ATen's kernels, the processor (its model name: MKL's choice depends on it) and
the variables that pin a library's choice when any is set, and the GPU where one ran, so that two runs that differ
can be told apart from a bug, and a resume on other arithmetic is said, not silent. Records written before the
processor was recorded lack it: a missing ``cpu`` is unknown, not a change.
"""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fedskew.engine.kernels import describe

FROM_ROUND = "from_round"
# the variables that pin a CPU library's choice of code (read when the library loads: set before Python starts)
PINS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
# absent from records written before they were recorded: unknown there, not a change
RECORDED_LATER = ("cpu", "tf32", "cudnn_benchmark")


def processor() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux; else what ``platform`` knows)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return " ".join(line.split(":", 1)[1].split())
    return platform.processor() or platform.machine() or "unknown"


def numerics(device: str = "cpu") -> dict[str, str]:
    """The arithmetic of this process: torch's version, ATen's CPU kernels' instruction set, the processor, the
    variables pinning a CPU library's code (``pins``, only when one is set), and for a CUDA device the GPU's name (its
    kernels are chosen by its architecture) and the TF32 and cuDNN benchmark flags in force."""
    record = {
        "torch": str(torch.__version__),
        "cpu_kernels": str(torch.backends.cpu.get_cpu_capability()),
        "cpu": processor(),
    }
    pins = [f"{name}={os.environ[name]}" for name in PINS if os.environ.get(name)]
    if pins:
        record["pins"] = ", ".join(pins)
    if device.startswith("cuda") and torch.cuda.is_available():
        record["gpu"] = torch.cuda.get_device_name(torch.device(device))
        record.update(describe())  # the TF32 and cuDNN benchmark flags in force (engine/kernels.py)
    return record


def differences(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What changed between two records (``"cpu_kernels AVX512 -> AVX2"``), the round markers left out; a key
    recorded only in later versions (:data:`RECORDED_LATER`) counts only where both records have it."""
    keys = sorted((set(before) | set(now)) - {FROM_ROUND})
    keys = [k for k in keys if k not in RECORDED_LATER or (k in before and k in now)]
    return [f"{k} {before.get(k, '-')} -> {now.get(k, '-')}" for k in keys if before.get(k) != now.get(k)]


def continue_record(segments: list[dict[str, Any]], first_round: int, here: Mapping[str, str]) -> tuple[list, str]:
    """The run's record of its arithmetic after (re)starting at ``first_round`` here: a list of segments, each the
    record of the process that ran the rounds from its ``from_round`` on. A resume on other arithmetic opens a new
    segment and returns the note to print (else ``""``)."""
    if not segments:
        return [{FROM_ROUND: first_round, **here}], ""
    changed = differences(segments[-1], here)
    if not changed:
        return list(segments), ""
    note = (
        f"resuming on other arithmetic ({'; '.join(changed)}): rounds {first_round} on will not be bit for bit those "
        "of an uninterrupted run (summary.json's `numerics` lists both)"
    )
    return [*segments, {FROM_ROUND: first_round, **here}], note


__all__ = ["continue_record", "differences", "numerics", "processor"]
