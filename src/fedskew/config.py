"""The run configuration: one validated schema, filled from defaults < YAML file < command-line flags."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from fedskew.data.settings import DataSettings
from fedskew.engine.settings import RoundSettings
from fedskew.schema import ConfigError, StrictSettings, describe_errors, read_yaml

# the largest seed: exact as a float (JSON, the database) and small enough for every derived torch seed
MAX_SEED = 2**53 - 1

# given: the data's own client assignment (per-client files, e.g. PFLlib's dataset folder with --dataset npz)


from fedskew.config_keys import (  # noqa: E402, F401 - re-exported: the run configuration's key sets
    ADDED_AT_DEFAULT,
    DOMAIN_DATASETS,
    DOMAIN_ONLY,
    NOT_IDENTITY,
    SETTING_KEYS,
    TRAINING_KEYS,
)


class RunConfig(StrictSettings):
    """Every setting of one simulated federation. Defaults are the main job on the embedded digits data.

    Strict as every fedskew schema (:class:`fedskew.schema.StrictSettings`): unknown keys, non-finite floats and
    booleans given for numbers are refused with the key named."""

    model_config = ConfigDict(validate_assignment=True)

    # what to run
    method: str = Field("fedavg", description="method name or composition, e.g. fedavg, fedsa, fedprox+disco")
    method_args: dict[str, Any] = Field(default_factory=dict, description="method hyper-parameters")
    # data
    dataset: str = Field(
        "digits", description="digits (embedded), mnist, fmnist, ..., folder or npz (your data, with data_dir)"
    )
    data_dir: str | None = Field(None, description="directory with the dataset files (env FEDSKEW_DATA)")
    download: bool = Field(
        False, description="fetch missing official dataset files into data_dir (MD5-checked; needs the network)"
    )
    protocol: str = Field(
        "fedskew",
        description="fedskew | pfllib: PFLlib's data split and evaluation semantics | fedcac: FedCAC's fixed-size "
        "client train and test samples with shared class proportions | niid-bench: NIID-Bench's partitions, "
        "settings and final-round accuracy (docs/protocols.md)",
    )
    partition: str = Field(
        "dir",
        description="iid | dir | pat | dirfixed | niid2 | biased | quantity | domain | given, or a registered scheme "
        "(fedskew.partition; `fedskew partition --list`)",
    )
    partition_args: dict[str, Any] = Field(
        default_factory=dict, description="a registered partition scheme's own parameters (-P KEY=VALUE)"
    )
    dataset_args: dict[str, Any] = Field(
        default_factory=dict,
        description="the dataset reader's own options (-D KEY=VALUE), e.g. hf: image=img label=character",
    )
    alpha: float = Field(0.1, gt=0, description="Dirichlet concentration (dir, dirfixed, quantity)")
    classes_per_client: int = Field(2, ge=1, description="classes per client (pat), per biased client (biased)")
    uniform_clients: int = Field(
        1, ge=0, description="biased: clients holding every class; the other clients are biased (FedDisco's AG News)"
    )
    pat_scheme: Literal["random", "pfllib", "niid-bench"] = Field(
        "random", description="pat: random classes, PFLlib's blocks, or NIID-Bench's #C=k (class i mod C + k-1 random)"
    )
    min_size: int = Field(10, ge=1, description="minimum samples per client (dir)")
    samples_per_client: int = Field(500, ge=2, description="samples per client (dirfixed)")
    test_samples_per_client: int = Field(100, ge=1, description="local test samples per client (protocol fedcac)")
    domain_fraction: float = Field(
        0.01, gt=0, le=1, description="share of its domain's training set each client gets (domain; FedHEAL: 1%)"
    )
    image_size: int = Field(28, ge=8, description="common image side of the domains (domain suites)")
    resize: int | None = Field(
        None, ge=8, description="dataset folder: resize every image to resize x resize (needed when sizes differ)"
    )
    imbalance_ratio: float | None = Field(
        None,
        ge=1,
        description="global long-tail imbalance (largest/smallest class size) of the training pool",
    )
    feature_noise: float = Field(
        0.0,
        ge=0,
        description="noise-based feature skew (protocol niid-bench): client i's images in [0, 1] get Gaussian noise "
        "of std feature_noise * i / (clients - 1)",
    )
    noise_draw: Literal["access", "once"] = Field(
        "access",
        description="feature_noise: drawn afresh for every training batch (access, NIID-Bench's data loader) or once "
        "per sample (once)",
    )
    clients: int = Field(10, ge=1, description="number of clients")
    train_ratio: float = Field(0.75, gt=0, lt=1, description="per-client train share; the rest is its local test")
    holdout: float = Field(
        0.2, gt=0, lt=1, description="global test share of the pool, for datasets without an official test split"
    )
    validation: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="share of every client's training split held out as its validation split (0: none); the "
        "clients do not train on it",
    )
    evaluate_on: Literal["test", "validation"] = Field(
        "test",
        description="validation: every evaluation view scores the clients' validation splits instead of the test "
        "sets, which are then never read (what `fedskew tune` runs); needs validation > 0",
    )
    # federation
    rounds: int = Field(100, ge=1, description="communication rounds")
    join_ratio: float = Field(1.0, gt=0, le=1, description="share of clients sampled each round")
    # local training
    local_epochs: int = Field(1, ge=1, description="local epochs per round")
    batch_size: int = Field(10, ge=1, description="local batch size")
    lr: float = Field(0.05, gt=0, description="local SGD learning rate")
    momentum: float = Field(0.0, ge=0, lt=1, description="local SGD momentum")
    weight_decay: float = Field(0.0, ge=0, description="local SGD weight decay")
    drop_last: bool = Field(
        False, description="drop each epoch's last partial batch (PFLlib's loaders do; fedskew keeps it by default)"
    )
    model: str = Field(
        "auto", description="mlp, cnn, lenet, resnet8/10/18/34, textcnn or charlstm (token ids), or auto"
    )
    norm: Literal["bn", "gn"] = "bn"
    divergence_factor: float = Field(
        100.0,
        ge=0,
        description="stop and flag the run as diverged when a round's training loss exceeds this multiple of "
        "ln(classes), the loss of a uniform prediction, or is not finite (0: only non-finite)",
    )
    on_bad_update: Literal["fail", "drop"] = Field(
        "fail",
        description="a client upload that is non-finite, mis-shaped or of the wrong dtype: fail the run (in a "
        "simulation a non-finite upload is divergence) or drop it from the round, logged with the client and reason",
    )
    client_dropout: float = Field(
        0.0, ge=0, lt=1, description="probability that a sampled client fails to report in a round (seeded)"
    )
    client_sampling: Literal["fixed", "poisson"] = Field(
        "fixed",
        description="fixed: round(join_ratio * clients) distinct clients a round; poisson: each client joins "
        "independently with probability join_ratio (what DP's amplification by Poisson sampling assumes)",
    )
    # user-level differential privacy (docs/privacy.md): on when dp_clip is set
    dp_clip: float | None = Field(
        None, gt=0, description="DP: every client's update clipped to this L2 norm (turns user-level DP on)"
    )
    dp_noise: float | None = Field(None, gt=0, description="DP: the noise multiplier z (noise std / sensitivity)")
    dp_epsilon: float | None = Field(
        None, gt=0, description="DP: the epsilon budget; without dp_noise, z is calibrated to spend it in the rounds"
    )
    dp_delta: float = Field(1e-5, gt=0, lt=1, description="DP: delta of the (epsilon, delta) guarantee")
    dp_accountant: Literal["rdp", "pld"] = Field("rdp", description="DP: the accountant (dp-accounting)")
    dp_weight_cap: float | None = Field(
        None,
        gt=0,
        description="DP, non-uniform weights: w_k = min(v_k / cap, 1), v_k the client's sample count (FedDisco: its "
        "weight over the federation) (default: the mean of v over the clients)",
    )
    dp_clip_quantile: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="DP, adaptive clipping (Andrew et al. 2021): the quantile of the update norms the clip tracks "
        "(e.g. 0.5; dp_clip is then its initial value)",
    )
    dp_clip_lr: float = Field(0.2, gt=0, description="DP, adaptive clipping: the geometric update's rate")
    dp_count_noise: float | None = Field(
        None, gt=0, description="DP, adaptive clipping: the std of the noise on the clipped count (default cohort/20)"
    )
    dp_extras_scale: float = Field(
        1.0,
        gt=0,
        description="DP, a client part that uploads extras (SCAFFOLD's control delta): they enter the jointly "
        "clipped vector multiplied by this and the server divides their noised sum by it; SCAFFOLD's control delta "
        "is about the model's delta / (lr × local steps), so lr × local steps balances the two",
    )
    dp_report_noise: float | None = Field(
        None,
        gt=0,
        description="DP, weights that read a client report (FedDisco's d_k): the noise multiplier of its one-off "
        "release (Gaussian std = this times the report's range), composed in the accountant",
    )
    # evaluation and output
    eval_every: int = Field(1, ge=1, description="evaluate every N rounds (and always the last)")
    eval_batch_size: Literal["auto"] | int = Field(
        "auto",
        description="evaluation batch (auto: on CPU the largest whose biggest layer output stays under 16 MiB, "
        "so no memory is re-mapped every batch; 2048 on a GPU)",
    )
    eval_clients: int | None = Field(
        None,
        ge=1,
        description="views of per-client models (personalized, trained, local entries): score a seeded sample of "
        "this many clients per evaluated round, every client at the last round (default: all, every time)",
    )
    validation_select: bool = Field(
        False,
        description="score the clients' validation splits (validation > 0) at every evaluated round and record each "
        "metric's validation-selected round: chosen on them, reported on the test data",
    )
    heldout_clients: int = Field(
        0,
        ge=0,
        description="the last K of the clients never train (PFLlib's num_new_clients): every evaluation scores the "
        "global model on their test splits and, for a personalized method, the model its client part makes from "
        "the global one in one local round",
    )
    last_n: int = Field(10, ge=1, description="summaries average the last N evaluated rounds")
    skew_probes: int = Field(
        4, ge=0, description="per layer, positions whose client values are recorded for `fedskew skew` (0: off)"
    )
    checkpoint_every: Literal["auto"] | int = Field(
        "auto",
        description="write a resumable checkpoint every K rounds (0: never; auto: as often as keeps the writing "
        "under 2% of the run time, and always on an interruption); see docs/guide.md, long runs",
    )
    seed: int = Field(
        0,
        ge=0,
        le=MAX_SEED,
        description="the one seed of the run (partition, sampling, init, shuffling); 0 to 2**53 - 1",
    )
    data_seed: int | None = Field(
        None,
        ge=0,
        le=MAX_SEED,
        description="the federation's own seed (partition, splits, the data's own draws), in place of seed for "
        "them alone: fixed while seed varies, every run trains the same clients' data and differs in init, "
        "sampling and shuffling (default: seed)",
    )
    partition_rng: Literal["derived", "raw"] = Field(
        "derived",
        description="the partition's random generator: derived (a stream of the federation seed for the partition "
        "alone, fedskew's) or raw (numpy.random.default_rng(federation seed) itself, as a benchmark's own script "
        "seeds its partitioner: Flower's niid_bench draws every run's partition from default_rng(42), so "
        "--data-seed 42 --partition-rng raw under protocol niid-bench is that partition, client for client, for "
        "iid, dir and pat)",
    )
    device: str = Field("cpu", description="cpu, cuda, cuda:1, ...")
    threads: int = Field(
        1, ge=0, description="torch CPU threads (0: torch's default); 1 is fastest for small-batch FL simulation"
    )
    workers: int = Field(
        1,
        ge=1,
        description="processes that train the sampled clients in parallel (CPU; results identical to 1); each uses "
        "one torch thread",
    )
    batched_clients: bool = Field(
        False,
        description="train the sampled clients together, vmapped over stacked parameters (engine/batched.py; for a "
        "GPU); equal to the sequential loop up to float32 rounding; methods it cannot batch fall back, with a warning",
    )
    capture_steps: bool = Field(
        False,
        description="with batched_clients: every step at one of a few padded, masked shapes (engine/captured.py), "
        "captured once per shape as a CUDA graph and replayed on a CUDA device (run eagerly elsewhere); equal to the "
        "sequential loop up to float32 rounding; BatchNorm models and loss terms fall back, with a warning",
    )
    stacked_conv: str = Field(
        "grouped",
        description="with batched_clients, a model of standard layers: its convolutions over the stacked clients as "
        "one grouped convolution (grouped), as each client's patches unfolded (im2col) times its filters in one "
        "batched matmul (unfold), or as one ordinary convolution per client (per_client) (engine/stacked.py); or a "
        "comma-separated list, one form per Conv2d layer in the model's order (per_client,grouped); the same values "
        "up to float32 rounding; which is faster depends on the device and the layer (benchmarks/conv_forms.py)",
    )
    tf32: Literal["torch", "on", "off"] = Field(
        "torch",
        description="torch | on | off: on a CUDA device, TensorFloat-32 arithmetic (engine/kernels.py): torch keeps "
        "torch's flags (by default TF32 in cuDNN's convolutions, not in matmuls), on allows it in both (faster "
        "matmuls and unfolded convolutions on Ampere or later GPUs; float32 results to about 1e-3 relative "
        "rounding), off in neither (full float32); a CPU run computes without it",
    )
    precision: Literal["float32", "bf16"] = Field(
        "float32",
        description="float32 | bf16: the arithmetic of local training's forward passes and losses "
        "(client/precision.py): bf16 runs them under bfloat16 autocast (matmuls and convolutions in bfloat16, "
        "several times faster on a GPU's tensor cores; losses, reductions, parameters, gradients, optimizer, client "
        "state, aggregation and evaluation stay float32; no loss scaling needed); a run's results change with it",
    )
    cudnn_benchmark: bool = Field(
        False,
        description="on a CUDA device, cuDNN times its convolution algorithms at each new shape and keeps the fastest "
        "(torch.backends.cudnn.benchmark): faster convolutions after each shape's first step; the algorithm it keeps, "
        "and with it the float rounding, may differ from run to run; false leaves torch's setting",
    )
    aggregation: Literal["auto", "stacked", "streaming", "disk"] = Field(
        "auto",
        description="the server's uploads: stacked ([clients, ...] buffers, what every server method can read), "
        "streaming (a weighted mean summed upload by upload, memory O(model): FedAvg, FedProx, SCAFFOLD, Ditto, "
        "FedAvgM, ...; equal up to float64 rounding; needs skew_probes 0) or disk (stacked in unnamed files in the "
        "run directory, read block by block: identical results, CPU only); auto: streaming when the composition "
        "allows it, skew_probes is 0 and the stacked uploads would take over 512 MiB, else disk when they would "
        "exceed state_memory",
    )
    channels_last: bool = Field(
        False,
        description="keep convolution weights and activations in channels-last memory order (faster convolutions "
        "on CPU, benchmarks/round_time.py), the stacked grouped convolutions of batched_clients too; equal to the "
        "default layout up to float32 rounding",
    )
    state_store: Literal["auto", "memory", "disk"] = Field(
        "auto",
        description="where per-client state lives (own models, control variates, personalized models): memory, or "
        "disk (arrays in <run dir>/client_state, only a round's clients in RAM; identical results); auto: disk when "
        "the estimate exceeds state_memory",
    )
    state_memory: int | str | None = Field(
        None,
        description="RAM budget for per-client state under state_store auto, and for a round's stacked uploads under "
        "aggregation auto, e.g. 2GB or 512MiB (default: a quarter of this machine's RAM)",
    )
    log: list[str] = Field(
        default_factory=list,
        description="live loggers: tensorboard, mlflow, wandb (or a comma-separated string); each needs its extra "
        "(pip install 'fedskew[loggers]'); see docs/loggers.md",
    )
    log_group: str | None = Field(
        None, description="the trackers' group / MLflow experiment (sweeps: the sweep's name; tune: the study's)"
    )
    log_uri: str | None = Field(
        None, description="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else a file store runs/mlruns)"
    )
    out: str | None = Field(None, description="run directory (default runs/<name>)")
    db: str | None = Field("runs/fedskew.db", description="SQLite results database; null (or none) to disable")

    @field_validator("db", mode="before")
    @classmethod
    def _no_db(cls, v: Any) -> Any:
        """``--db null`` (or ``none``) disables the database, as ``db: null`` does in YAML, instead of naming a file."""
        if isinstance(v, str) and v.strip().lower() in ("null", "none", "~"):
            return None
        return v

    @field_validator("eval_batch_size", "checkpoint_every")
    @classmethod
    def _auto_or_count(cls, v: str | int, info: ValidationInfo) -> str | int:
        """``auto`` or a count: eval_batch_size >= 1, checkpoint_every >= 0 (0: never)."""
        least = {"eval_batch_size": 1, "checkpoint_every": 0}[info.field_name]
        if v != "auto" and v < least:
            raise ValueError(f"must be auto or an integer >= {least}")
        return v

    @field_validator("stacked_conv")
    @classmethod
    def _conv_forms(cls, v: str) -> str:
        """One of the stacked convolutions' forms, or a comma-separated list of them (one per Conv2d layer)."""
        from fedskew.engine.stacked import RUN_CONV_FORMS

        forms = [f.strip() for f in v.split(",")]
        bad = [f for f in forms if f not in RUN_CONV_FORMS]
        if bad:
            raise ValueError(
                f"{bad[0]!r} is not a form: give one of {', '.join(RUN_CONV_FORMS)}, or a comma-separated list of them "
                "with one per Conv2d layer"
            )
        return ",".join(forms)

    @field_validator("state_memory")
    @classmethod
    def _size(cls, v: int | str | None) -> int | str | None:
        from fedskew.sizes import parse_size

        if v is not None:
            parse_size(v)  # ValueError: not a size
        return v

    @field_validator("log", mode="before")
    @classmethod
    def _log_names(cls, v: Any) -> list[str]:
        from fedskew.results.loggers import parse_names

        return parse_names(v)

    @field_validator("model")
    @classmethod
    def _model_known(cls, v: str) -> str:
        from fedskew.models import MODELS

        # "custom:<name>" records a user's model (fedskew.run(model=...)); only the library API can supply it
        if v != "auto" and v not in MODELS and not (v.startswith("custom:") and len(v) > 7):
            raise ValueError(f"unknown model {v!r}; choose auto or one of {', '.join(MODELS)}")
        return v

    @field_validator("device")
    @classmethod
    def _device_ok(cls, v: str) -> str:
        import torch

        try:
            dev = torch.device(v)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"not a torch device: {v!r}") from exc
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {v!r} requested but CUDA is not available")
        return v

    @field_validator("protocol")
    @classmethod
    def _protocol_known(cls, v: str) -> str:
        from fedskew.data.protocols import PROTOCOLS

        if v not in PROTOCOLS:
            raise ValueError(f"unknown protocol {v!r}; choose one of {', '.join(PROTOCOLS)}")
        return v

    @field_validator("partition")
    @classmethod
    def _partition_known(cls, v: str) -> str:
        from fedskew.data.partition.registry import PARTITIONS, RESERVED, load_entry_points

        load_entry_points()
        if v not in PARTITIONS and v not in RESERVED:
            raise ValueError(f"unknown partition {v!r}; choose one of {', '.join([*PARTITIONS, *RESERVED])}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _hf_name(cls, values: Any) -> Any:
        """``dataset: hf:NAME`` is ``dataset: hf`` reading NAME from the local Hugging Face cache (``-D hub=NAME``)."""
        if isinstance(values, dict) and isinstance(values.get("dataset"), str) and values["dataset"].startswith("hf:"):
            hub = values["dataset"][3:].strip()
            if not hub:
                raise ValueError("dataset 'hf:NAME' needs the dataset's name after 'hf:' (e.g. hf:flwrlabs/femnist)")
            values = {**values, "dataset": "hf", "dataset_args": {**(values.get("dataset_args") or {}), "hub": hub}}
        return values

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        """The checks between settings (fedskew.config_checks), after each value was validated alone."""
        from fedskew.config_checks import check_run

        check_run(self)
        return self

    def identity(self) -> dict[str, Any]:
        """The settings that define an experiment (everything except seed and where output goes). For a dataset that
        *is* its data directory (folder, npz) the directory is part of it: two folders are two experiments."""
        ident = self.model_dump(exclude=NOT_IDENTITY)
        for key, default in ADDED_AT_DEFAULT.items():
            if ident.get(key) == default:
                del ident[key]
        from fedskew.config_checks import reads_data_dir

        if reads_data_dir(self.dataset):
            ident["data_dir"] = self.data_dir
        return ident

    def group_key(self) -> str:
        blob = json.dumps(self.identity(), sort_keys=True, default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]

    def data_settings(self) -> DataSettings:
        """What building the federation reads of this run (:func:`fedskew.data.federated.build_federated`)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(DataSettings)}
        return DataSettings(**{**values, "seed": self.federation_seed})

    @property
    def federation_seed(self) -> int:
        """The seed of everything that builds the federation: ``data_seed`` when set, else the run's ``seed``."""
        return self.seed if self.data_seed is None else self.data_seed

    def round_settings(self) -> RoundSettings:
        """What the server side of a round reads of this run (:class:`fedskew.engine.round_server.RoundServer`)."""
        return RoundSettings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RoundSettings)})


def _format_validation_error(exc: ValidationError) -> str:
    return "invalid configuration:\n  " + "\n  ".join(describe_errors(exc, RunConfig))


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    data = read_yaml(p)  # UTF-8, every key once (a duplicate would silently take the last value)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of settings, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def make_config(file_values: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Defaults < protocol preset < file values < overrides (``None`` overrides are ignored), validated as a whole."""
    values: dict[str, Any] = dict(file_values or {})
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k in ("method_args", "partition_args", "dataset_args"):
            values[k] = {**values.get(k, {}), **v}
        else:
            values[k] = v
    from fedskew.data.protocols import PROTOCOLS

    # applied under --protocol X unless the file or a flag sets the key (docs/protocols.md)
    protocol = PROTOCOLS.get(str(values.get("protocol")))
    values = {**(protocol.defaults if protocol is not None else {}), **values}
    try:
        return RunConfig(**values)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)
