"""One run seed, independent streams per purpose.

Every random choice in a run draws from a stream derived from the run seed and a purpose key with
:class:`numpy.random.SeedSequence`, never from global RNG state. Streams for different purposes (or clients, or
rounds) are statistically independent, and adding a new purpose never shifts an existing one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum

import numpy as np
import torch


class Purpose(IntEnum):
    PARTITION = 1
    SAMPLING = 2
    INIT = 3
    SHUFFLE = 4
    SPLIT = 5
    DATA = 6
    DROPOUT = 7
    FEDGEN = 8  # FedGen's server-side generator: its initial weights and each round's training draws
    EVAL_SAMPLE = 9  # the clients whose per-client models an evaluated round scores (eval_clients)
    CALIBRATION = 10  # a post-hoc calibration's draws at an evaluated round (CCVR's virtual features, their order)
    PERSONALIZE = 11  # a client part's personalization at evaluation (Per-FedAvg's adaptation batch)
    DOWNLOADS = 12  # a server half's draws of what one client alone is sent (FedFomo's exploring peers)
    DP_NOISE = 13  # the Gaussian noise of a DP round's release (docs/privacy.md)
    DP_REPORT = 14  # the Gaussian noise of a client report's release under DP (FedDisco's d_k), keyed by client
    SECAGG = 15  # SecAgg+'s stochastic rounding of a client's upload (Flower's quantization), keyed by client, round


def seed_sequence(seed: int, purpose: Purpose, *keys: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([int(seed), int(purpose), *(int(k) for k in keys)])


def numpy_rng(seed: int, purpose: Purpose, *keys: int) -> np.random.Generator:
    """A numpy generator for ``purpose`` (and e.g. client id and round)."""
    return np.random.default_rng(seed_sequence(seed, purpose, *keys))


def partition_generator(seed: int, rule: str = "derived") -> np.random.Generator:
    """The partition's generator: ``derived``, the partition's own stream of ``seed`` (as every purpose); ``raw``,
    ``numpy.random.default_rng(seed)`` itself, as a benchmark's script seeds its partitioner, so that the same
    partitioning rule draws that benchmark's partition (Flower's niid_bench: ``default_rng(42)``). The partition's
    secondary streams (e.g. protocol fedcac's test draw) stay derived either way."""
    if rule == "raw":
        return np.random.default_rng(int(seed))
    if rule != "derived":
        raise ValueError(f"partition_rng must be 'derived' or 'raw', got {rule!r}")
    return numpy_rng(seed, Purpose.PARTITION)


def torch_seed(seed: int, purpose: Purpose, *keys: int) -> int:
    """A 63-bit integer seed for a torch generator."""
    return int(seed_sequence(seed, purpose, *keys).generate_state(2, np.uint64)[0] >> np.uint64(1))


def torch_generator(seed: int, purpose: Purpose, *keys: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(torch_seed(seed, purpose, *keys))
    return g


# the process's one global torch RNG: a seeded section (model initialization) must not interleave with another
# thread's use of it (several runs in the threads of one process: engine/stacked_runs.py)
_GLOBAL_RNG = threading.RLock()


@contextmanager
def global_rng(seed: int | None = None) -> Iterator[None]:
    """A section that draws from torch's global RNG and leaves it as it found it (``fork_rng``), seeded with ``seed``
    when given, and held against every other thread's such section (so runs in threads stay exactly reproducible)."""
    with _GLOBAL_RNG, torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        yield
