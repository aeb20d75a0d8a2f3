"""Which arithmetic produced a run's numbers, recorded beside them.

A run repeats bit for bit on the same kind of machine (one seed drives everything: ``fedskew/seeding.py``). Across
machines it need not: PyTorch dispatches its CPU kernels (reductions, softmax, elementwise maths) by the instruction
set it finds (``torch.backends.cpu.get_cpu_capability()``: ``AVX2``, ``AVX512``, ...), and kernels of different vector
width sum in different orders. Measured here (docs/guide.md, "Reproducibility"): the default digits run's round-1
training loss is 1.7494151008960812 with the AVX2 kernels and 1.749415117308151 with the scalar ones
(``ATEN_CPU_CAPABILITY=default``); twenty rounds of training grow such differences into accuracies that differ in the
first decimal. The record names the kernels (and the GPU) so that two runs that differ can be told apart from a
bug, and a resume on other arithmetic is said, not silent. ``ATEN_CPU_CAPABILITY`` (set before ``torch`` is imported)
pins the kernels: a machine runs the kernels of any narrower instruction set it has, so a table meant to be checked on
other machines can be made with ``ATEN_CPU_CAPABILITY=avx2``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

FROM_ROUND = "from_round"


def numerics(device: str = "cpu") -> dict[str, str]:
    """The arithmetic of this process: torch's version, its CPU kernels' instruction set, and for a CUDA device the
    GPU's name (its kernels are chosen by its architecture)."""
    record = {"torch": str(torch.__version__), "cpu_kernels": str(torch.backends.cpu.get_cpu_capability())}
    if device.startswith("cuda") and torch.cuda.is_available():
        record["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return record


def differences(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """What changed between two records (``"cpu_kernels AVX512 -> AVX2"``), the round markers left out."""
    keys = sorted((set(before) | set(now)) - {FROM_ROUND})
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


__all__ = ["continue_record", "differences", "numerics"]
