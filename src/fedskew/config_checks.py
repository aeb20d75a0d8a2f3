"""The checks between a run's settings, after each value was validated alone (:class:`fedskew.config.RunConfig`'s
last validator calls :func:`check_run`). Each names the settings that clash and what would fix them; pydantic
reports a ``ValueError`` raised here as the configuration's error."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedskew.config_keys import DOMAIN_DATASETS, DOMAIN_ONLY

if TYPE_CHECKING:
    from fedskew.config import RunConfig
    from fedskew.methods import Method

DP_KEYS = ("dp_noise", "dp_epsilon", "dp_weight_cap", "dp_clip_quantile", "dp_count_noise", "dp_report_noise")


def check_run(cfg: RunConfig) -> None:
    """Every check between settings, in the order a reader fixes them: the data, the evaluation, the method with its
    hyper-parameters, privacy, then the engine's options."""
    from fedskew.methods import resolve_method

    check_partition(cfg)
    check_dataset(cfg)
    check_evaluation(cfg)
    check_protocol(cfg)
    # the name and its hyper-parameters are validated together: a composition may need an argument to be valid
    # (fedsa+disco needs low_weighting=samples)
    method = resolve_method(cfg.method, cfg.method_args)
    check_privacy(cfg)
    check_engine(cfg, method)
    check_method_needs(cfg, method)


def check_partition(cfg: RunConfig) -> None:
    """A registered scheme's parameters, and the domain suites with partition domain (and it with them)."""
    from fedskew.data.partition.registry import BUILTIN, PartitionError, check_partition_params

    if cfg.partition in BUILTIN or cfg.partition in ("domain", "given", "natural"):
        if cfg.partition_args:
            raise ValueError(
                f"partition {cfg.partition!r} takes its parameters from its own settings (alpha, "
                f"classes_per_client, ...); partition_args is for a registered scheme, got {cfg.partition_args}"
            )
    else:
        try:
            check_partition_params(cfg.partition, cfg.partition_args)
        except PartitionError as exc:
            raise ValueError(str(exc)) from None
    if (cfg.partition == "domain" and cfg.dataset not in DOMAIN_DATASETS) or (
        cfg.partition != "domain" and cfg.dataset in DOMAIN_ONLY
    ):
        raise ValueError(
            f"partition 'domain' goes with a multi-domain dataset ({', '.join(DOMAIN_DATASETS)}), and "
            f"{', '.join(DOMAIN_ONLY)} with partition 'domain' only; got dataset {cfg.dataset!r} with partition "
            f"{cfg.partition!r}"
        )


def check_protocol(cfg: RunConfig) -> None:
    """What the evaluation protocol refuses of the data settings (fedskew.data.protocols)."""
    from fedskew.data.protocols import PROTOCOLS

    refused = PROTOCOLS[cfg.protocol].refuse(cfg.partition, cfg.imbalance_ratio, cfg.feature_noise)
    if refused is not None:
        raise ValueError(refused)


def reads_data_dir(dataset: str) -> bool:
    """Whether ``dataset`` is read from ``data_dir`` itself (``folder``, ``npz``, plug-ins declaring it)."""
    from fedskew.data.readers import find_spec

    spec = find_spec(dataset)
    return spec is not None and spec.needs_data_dir


def check_dataset(cfg: RunConfig) -> None:
    """What the dataset's reader needs and allows (fedskew.data.readers registry): a data_dir for the datasets that
    are their folder, ``resize`` only where the reader takes it, ``partition given`` only for a reader of per-client
    files, and no re-sampling of given clients. Unknown names are left to the reader, which lists the choices."""
    from fedskew.data.readers import find_spec

    spec = find_spec(cfg.dataset)
    if spec is not None and spec.needs_data_dir and not cfg.data_dir:
        raise ValueError(
            f"dataset {cfg.dataset!r} reads the folder given as data_dir (--data-dir DIR): {spec.expected}"
        )
    if cfg.resize is not None and (spec is None or "resize" not in spec.options):
        raise ValueError(f"resize applies to image-folder datasets (folder), not to dataset {cfg.dataset!r}")
    unknown = sorted(set(cfg.dataset_args) - set(spec.options if spec is not None else ()))
    if unknown and spec is not None:
        takes = ", ".join(spec.options) or "none"
        raise ValueError(f"dataset {cfg.dataset!r} does not take option(s) {unknown} (-D); its options: {takes}")
    if cfg.partition in ("given", "natural"):
        if spec is not None and not spec.per_client:  # unknown names: user data given through fedskew.api
            raise ValueError(
                f"partition {cfg.partition!r} uses the clients of per-client data (dataset npz with train/0.npz, "
                f"LEAF's femnist, shakespeare, sent140, ...); dataset {cfg.dataset!r} has none: choose a partition "
                "such as dir or iid"
            )
        if cfg.imbalance_ratio is not None:
            raise ValueError(
                f"partition {cfg.partition!r} keeps the clients' data as given: imbalance_ratio must be unset, got "
                f"{cfg.imbalance_ratio!r}"
            )


def check_evaluation(cfg: RunConfig) -> None:
    """Validation splits where the evaluation reads them, and clients left to train beside the held-out ones."""
    if cfg.evaluate_on == "validation" and not cfg.validation:
        raise ValueError(
            "evaluate_on 'validation' scores the clients' validation splits: set validation to a share in (0, 1) "
            "(e.g. 0.2)"
        )
    if cfg.validation_select and (not cfg.validation or cfg.evaluate_on != "test"):
        raise ValueError(
            "validation_select chooses a round on the clients' validation splits and reports the test data: set "
            "validation to a share in (0, 1) (e.g. 0.1) and keep evaluate_on test"
        )
    if cfg.heldout_clients >= cfg.clients:
        raise ValueError(f"heldout_clients={cfg.heldout_clients} must leave clients that train (clients={cfg.clients})")


def check_privacy(cfg: RunConfig) -> None:
    """User-level DP is on when dp_clip is set: its other settings need it, and it needs a noise or a target."""
    if cfg.dp_extras_scale != 1.0 and cfg.dp_clip is None:
        raise ValueError("dp_extras_scale needs dp_clip (differential privacy is on when dp_clip is set)")
    dp_set = [k for k in DP_KEYS if getattr(cfg, k) is not None]
    if dp_set and cfg.dp_clip is None:
        raise ValueError(f"{', '.join(dp_set)} need dp_clip (differential privacy is on when dp_clip is set)")
    if cfg.dp_clip is not None:
        if cfg.dp_noise is None and cfg.dp_epsilon is None:
            raise ValueError("differential privacy needs dp_noise (the noise multiplier) or dp_epsilon (a target)")
        if cfg.batched_clients:
            raise ValueError("differential privacy clips each client's update: batched_clients is not supported")


def check_engine(cfg: RunConfig, method: Method) -> None:
    """The engine's options against each other and against the method: captured steps, the precision on the device,
    disk and streaming aggregation."""
    if cfg.capture_steps and not cfg.batched_clients:
        raise ValueError("capture_steps shapes the batched step: it needs batched_clients")
    if cfg.precision != "float32":  # a device without bfloat16 autocast, said before the run starts
        from fedskew.client.precision import autocast

        autocast(cfg.device, cfg.precision)
    if cfg.aggregation == "disk" and cfg.device.split(":")[0] != "cpu":
        raise ValueError(f"aggregation disk maps the uploads from files on the CPU; device is {cfg.device!r}")
    if cfg.aggregation == "streaming":
        from fedskew.server.streaming import stream_refusal

        why = stream_refusal(method) or (
            "user-level DP noises the stacked sum (aggregation streaming is not built for it)"
            if cfg.dp_clip is not None
            else "the skew probes read every upload: set skew_probes 0"
            if cfg.skew_probes
            else None
        )
        if why is not None:
            raise ValueError(f"aggregation streaming: method {cfg.method!r}: {why}")


def check_method_needs(cfg: RunConfig, method: Method) -> None:
    """What the method's client part declares it needs of the data (a validation split)."""
    from fedskew.client.local import unwrapped

    if getattr(method.client, "needs_validation", False) and not cfg.validation:
        part = type(unwrapped(method.client)).__name__
        raise ValueError(
            f"method {cfg.method!r} scores each client's validation split (its client part {part}, or a "
            "wrapper such as AFL's loss=after): set validation to a share of the training split (e.g. 0.2)"
        )
