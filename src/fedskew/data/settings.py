"""What building a federation reads of a run: :class:`DataSettings`.

``fedskew.data`` never imports the run configuration (``fedskew.config``; tests/test_boundaries.py keeps it so): the
configuration builds these settings (:meth:`fedskew.config.RunConfig.data_settings`), and
:func:`fedskew.data.federated.build_federated` takes them, or anything that can make them (a ``RunConfig``). The values
arrive validated by the configuration; this module only names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, kw_only=True)
class DataSettings:
    """Every field building a federation reads: the source, the partition and its parameters, the clients' splits,
    the seed and the device. Names, meanings and defaults are those of :class:`fedskew.config.RunConfig` (no defaults
    here, so that they cannot drift apart)."""

    # the source
    dataset: str
    data_dir: str | None
    download: bool
    resize: int | None  # image folders: every image resized to resize x resize
    image_size: int  # domain suites: the domains' common image side
    # the protocol, the partition and its parameters
    protocol: str  # fedskew | pfllib | fedcac | niid-bench
    partition: str
    partition_args: dict[str, object]  # a registered scheme's own parameters (the built-in ones read the fields below)
    dataset_args: dict[str, object]  # the reader's own options (-D KEY=VALUE)
    alpha: float  # dir, dirfixed, quantity (as beta)
    min_size: int  # dir
    classes_per_client: int  # pat; biased (a biased client's classes)
    uniform_clients: int  # biased
    pat_scheme: str  # pat
    samples_per_client: int  # dirfixed, protocol fedcac
    test_samples_per_client: int  # protocol fedcac
    domain_fraction: float  # domain
    imbalance_ratio: float | None  # global long tail of the training pool
    feature_noise: float  # protocol niid-bench: the largest client's input noise std (pixels in [0, 1])
    noise_draw: str  # access (a fresh draw for every training batch) | once (drawn once per sample)
    # the clients and their splits
    clients: int
    heldout_clients: int  # the last K clients never train (evaluated only)
    train_ratio: float
    holdout: float
    validation: float
    evaluate_on: str  # test | validation
    batch_size: int  # PFLlib's least_samples (protocol pfllib)
    # seeding and placement
    seed: int  # the federation's: RunConfig.federation_seed (data_seed when set, else the run's seed)
    partition_rng: str  # derived (a stream of seed for the partition) | raw (numpy.random.default_rng(seed) itself)
    device: str


class HasDataSettings(Protocol):
    """Anything that can produce :class:`DataSettings` (a :class:`fedskew.config.RunConfig`)."""

    def data_settings(self) -> DataSettings: ...


def data_settings(source: DataSettings | HasDataSettings) -> DataSettings:
    """``source`` itself if it is :class:`DataSettings`, else ``source.data_settings()`` (a run configuration)."""
    return source if isinstance(source, DataSettings) else source.data_settings()
