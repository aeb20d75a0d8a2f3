"""The names the run configuration sorts its settings by: which define an experiment (its identity), which a setting,
which the local training, which were added after runs were recorded, and the domain suites. Kept apart from
:mod:`fedskew.config` (which re-exports them) so that the schema module stays one responsibility."""

from __future__ import annotations

from typing import Any

# the domain suites (fedskew.data.readers.domains, .office, .domain_suites)
DOMAIN_DATASETS = ("digits_domains", "office_caltech", "pacs", "office_home", "domainnet")
DOMAIN_ONLY = ("digits_domains",)  # read only as domains; office_caltech also reads pooled for the other partitions


# settings that change where a run goes, how fast it runs or when it is stopped, not what it computes
NOT_IDENTITY = frozenset(
    {
        "seed",
        "out",
        "db",
        "device",
        "threads",
        "data_dir",
        "download",
        "eval_batch_size",
        "divergence_factor",
        "checkpoint_every",
        "workers",
        "batched_clients",
        "capture_steps",
        "stacked_conv",
        "tf32",
        "cudnn_benchmark",
        "aggregation",
        "channels_last",
        "state_store",
        "state_memory",
        "log",
        "log_group",
        "log_uri",
    }
)


# keys added after runs were recorded with this schema: left out of an experiment's identity at their default, so
# that experiments recorded before keep their identity (group keys, sweep folder names)
ADDED_AT_DEFAULT: dict[str, Any] = {
    "uniform_clients": 1,
    "partition_args": {},
    "client_sampling": "fixed",
    "dp_clip": None,
    "dp_noise": None,
    "dp_epsilon": None,
    "dp_delta": 1e-5,
    "dp_accountant": "rdp",
    "dp_weight_cap": None,
    "dp_clip_quantile": None,
    "dp_clip_lr": 0.2,
    "dp_count_noise": None,
    "dp_report_noise": None,
    "dp_extras_scale": 1.0,
    "feature_noise": 0.0,
    "noise_draw": "access",
    "dataset_args": {},
    "heldout_clients": 0,
    "validation_select": False,
    "data_seed": None,
    "partition_rng": "derived",
    "precision": "float32",
}


# the keys that define a *setting*: the data and the federation (figures group an experiment's curves by them; an
# experiment's other keys, method, its arguments, lr, epochs, rounds, ..., tell the curves of one setting apart)
SETTING_KEYS = (
    "dataset",
    "protocol",
    "partition",
    "partition_args",
    "dataset_args",
    "alpha",
    "classes_per_client",
    "uniform_clients",
    "pat_scheme",
    "partition_rng",
    "min_size",
    "samples_per_client",
    "test_samples_per_client",
    "domain_fraction",
    "image_size",
    "imbalance_ratio",
    "feature_noise",
    "noise_draw",
    "clients",
    "train_ratio",
    "holdout",
    "join_ratio",
    "client_dropout",
    "heldout_clients",
)
# the local training and the model: with the setting, what tuned hyper-parameters are specific to (fedskew tune)
TRAINING_KEYS = ("local_epochs", "batch_size", "lr", "momentum", "weight_decay", "drop_last", "model", "norm")
