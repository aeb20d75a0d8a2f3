"""A Flower app's configuration is fedskew's run configuration: ``[tool.flwr.app.config]`` <-> :class:`RunConfig`.

Flower hands every app ``context.run_config``: the flat ``[tool.flwr.app.config]`` table of the app's
``pyproject.toml`` with ``flwr run --run-config "k=v ..."`` overrides (flwr refuses an override whose key the file does
not have, so :func:`app_config` writes every key). The keys are fedskew's own run-config keys (``rounds``,
``method``, ``local_epochs``, ... as in ``config.yaml``; ``-`` may stand for ``_``), plus three tables:

* ``method_args``: the method's hyper-parameters (``[tool.flwr.app.config.method_args]``, ``mu = 0.01``; a
  qualified one is a quoted key, ``"heal.tau" = 0.3``; a list is written as a string, ``target = "[0.2, 0.8]"``);
* ``partition_args``: a registered partition scheme's parameters (``[tool.flwr.app.config.partition_args]``);
* ``flower``: what only a deployment has, :class:`FlowerSettings` (how long a phase waits for replies, ...).

TOML has no null: ``""`` stands for an unset value (``out = ""``: the default run directory; ``db = ""``: no database).
Each SuperNode adds its own ``--node-config``: ``cid`` (its stable client id, 0..clients-1) and optionally
``data-dir`` (where its copy of the dataset lies, or under ``flower.data = "node"`` its own data; a quoted string)
and ``cache-dir`` (where it caches its part, :mod:`fedskew.flower.node_data`). This module needs no ``flwr``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import Field, ValidationError

from fedskew.config import ConfigError, RunConfig, make_config
from fedskew.flower import FLOWER_SPEC
from fedskew.methods import Method
from fedskew.schema import StrictSettings, describe_errors
from fedskew.server.streaming import secure_refusal

SERVER_APP = "fedskew.flower.server_app:app"
CLIENT_APP = "fedskew.flower.client_app:app"
METHOD_ARGS = "method_args"
PARTITION_ARGS = "partition_args"
DATASET_ARGS = "dataset_args"
ARG_TABLES = (METHOD_ARGS, PARTITION_ARGS, DATASET_ARGS)  # the run config's mappings, each a table of its own
ENGINE = "flower"

if TYPE_CHECKING:
    from fedskew.methods import Method


class FlowerSettings(StrictSettings):
    """What only a deployment needs (``[tool.flwr.app.config.flower]``); none of it changes what is computed, but for
    secure aggregation's quantization (``secagg``, :mod:`fedskew.flower.secagg`)."""

    round_timeout: float = Field(
        600.0,
        gt=0,
        description="seconds a phase (training, evaluation) waits for the clients' replies; a client "
        "that has not replied by then counts as failed for the round",
    )
    straggler_timeout: float | None = Field(
        None,
        gt=0,
        description="once a phase's first reply has arrived, seconds it waits for the others (a dead node then costs "
        "this, not round_timeout); unset: only round_timeout bounds the wait",
    )
    node_wait: float = Field(
        300.0, gt=0, description="seconds the ServerApp waits for the federation's `clients` SuperNodes to connect"
    )
    poll_interval: float = Field(0.5, gt=0, description="seconds between the ServerApp's pulls of replies")
    data: Literal["partition", "node"] = Field(
        "partition",
        description="partition: every node draws the simulator's partition of `dataset` and keeps (and caches) only "
        "its own part, a simulated deployment whose results equal `fedskew run`; node: each node's data-dir holds its "
        "own data, which is its part (a real federation; the server holds no client data)",
    )
    test_data: str | None = Field(
        None,
        description="data = node: a held-out test set on the server (an .npz with x_test, y_test or x, y) that it "
        "scores the global model on; unset: evaluation is federated only (the clients score the global model on "
        "their test splits)",
    )
    secagg: bool = Field(
        False,
        description="secure aggregation: the server learns each round's uploads only as their sum, through Flower's "
        "SecAgg+ protocol (compositions whose server reads a weighted sum with weights known before the round)",
    )
    secagg_shares: float = Field(
        1.0, gt=0, le=1, description="secagg: the share of a round's clients each client's key is split among"
    )
    secagg_threshold: float = Field(
        0.67,
        gt=0,
        le=1,
        description="secagg: the share of those that must complete the round to unmask it (more: safer against "
        "colluding clients, less tolerant of drop-outs; at least 2)",
    )
    secagg_clip: float = Field(
        8.0,
        gt=0,
        description="secagg: the range ±clip of every summed value (a client's weighted parameters, its extras); "
        "Flower quantizes it to 2**22 levels, and a client whose values leave it fails the round, saying so",
    )


SECAGG_MAX_COHORT = 2**32 // 2**22 - 1  # SecAgg+'s modulus over its quantization levels, less one


def secagg_refusal(cfg: RunConfig, method: Method) -> str | None:
    """Why ``cfg`` cannot run under SecAgg+ (``None``: it can): its server must read a weighted sum only, with weights
    it knows before the clients train, and no user-level DP beside it. (The skew probe, which reads each upload, is
    not taken: a secure round has no individual upload.)"""
    why = secure_refusal(method)
    if why is None and cfg.clients * cfg.join_ratio > SECAGG_MAX_COHORT:
        why = (
            f"its expected cohort ({cfg.clients * cfg.join_ratio:g} clients) exceeds the {SECAGG_MAX_COHORT} whose "
            "quantized sum SecAgg+'s modulus 2**32 holds"
        )
    if why is None and cfg.dp_clip is not None:
        why = "user-level DP with SecAgg+ is not built (the DP server reads the stacked uploads): use one or the other"
    return why


def check_secagg(cfg: RunConfig, method: Method) -> None:
    """Refuse a configuration SecAgg+ cannot carry, naming why (before anything runs)."""
    why = secagg_refusal(cfg, method)
    if why is not None:
        raise ConfigError(f"flower.secagg: {cfg.method} cannot be securely aggregated: {why}")


# data_dir of the server's configuration under flower.data = node: the data are where each node says (its data-dir)
NODE_DATA = "(each node's own data-dir)"
NOT_IN_HASH = ("data_dir", "out", "db", "device", "threads", "workers", "log", "log_group", "log_uri", "download")


def config_hash(cfg: RunConfig) -> str:
    """A short hash of what decides the numbers of a run (the node-local keys left out: ``data_dir``, output,
    device, threads): the hello refuses a node whose hash differs from the server's, as it refuses another fedskew
    version, because identical numbers need both."""
    blob = json.dumps(cfg.model_dump(exclude=set(NOT_IN_HASH)), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _none_if_empty(value: Any) -> Any:
    return None if value == "" else value


def _arg_value(value: Any) -> Any:
    """A method argument from the run config: ``""`` is unset, a string holding a YAML list or mapping is parsed
    (Flower's config carries no lists), anything else is taken as it is."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ConfigError(f"method argument {value!r} is not a valid YAML list or mapping ({exc})") from None
    return _none_if_empty(value)


def parse_run_config(
    run_config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None
) -> tuple[RunConfig, FlowerSettings]:
    """``context.run_config`` (flat, ``method_args.<key>``, ``partition_args.<key>`` and ``flower.<key>`` for the
    tables) -> the validated run configuration and the deployment settings; ``overrides`` (e.g. a node's ``data_dir``)
    win over the run config. Unknown keys are refused with the key named, as in a fedskew YAML file."""
    values: dict[str, Any] = {}
    tables: dict[str, dict[str, Any]] = {name: {} for name in ARG_TABLES}
    engine: dict[str, Any] = {}
    for key, value in run_config.items():
        head, dot, rest = str(key).partition(".")
        head = head.replace("-", "_")
        if head in tables and dot:
            tables[head][rest.replace("-", "_")] = _arg_value(value)
        elif head == ENGINE and dot:
            engine[rest.replace("-", "_")] = _none_if_empty(value)
        elif dot:
            known = ", ".join([*ARG_TABLES, ENGINE])
            raise ConfigError(f"run config key {key!r}: unknown table {head!r} (known: {known})")
        else:
            values[head] = _none_if_empty(value)
    values.update(tables)
    try:
        settings = FlowerSettings(**engine)
    except ValidationError as exc:
        lines = describe_errors(exc, FlowerSettings)
        raise ConfigError("invalid [tool.flwr.app.config.flower]:\n  " + "\n  ".join(lines)) from None
    overrides = dict(overrides or {})
    if settings.data == "node" and not values.get("data_dir") and "data_dir" not in overrides:
        values["data_dir"] = NODE_DATA  # the server (and a node started without its data-dir) reads no client data
    cfg = make_config(values, overrides)
    if cfg.heldout_clients:
        raise ConfigError(
            "heldout_clients runs in the simulation (fedskew run): in a Flower federation every node that joins trains"
        )
    if cfg.validation_select:
        raise ConfigError("validation_select runs in the simulation (fedskew run), not in a Flower federation")
    if cfg.feature_noise and (settings.data == "node" or cfg.noise_draw == "access"):
        raise ConfigError(
            "feature_noise on Flower: node-local data is used as it is, and the simulated federation's noise must be "
            "drawn once per sample (noise_draw once), not in the simulation's local loop"
        )
    return cfg, settings


def node_overrides(node_config: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
    """A SuperNode's ``--node-config``: its client id (``cid``; Flower's simulation sets ``partition-id`` instead)
    and the settings it overrides locally (``data-dir``)."""
    if "cid" in node_config:
        raw = node_config["cid"]
    elif "partition-id" in node_config:
        raw = node_config["partition-id"]
    else:
        raise ConfigError(
            'this SuperNode has no client id: start it with --node-config "cid=K" (K = 0..clients-1, stable '
            f"across runs); its node config is {dict(node_config)}"
        )
    if isinstance(raw, bool) or not isinstance(raw, int | str) or not str(raw).isdigit():
        raise ConfigError(f"node config cid must be a non-negative integer, got {raw!r}")
    overrides: dict[str, Any] = {}
    for key in ("data-dir", "data_dir"):
        if node_config.get(key):
            overrides["data_dir"] = str(node_config[key])
    return int(raw), overrides


# ---- writing an app folder ---------------------------------------------------------------------------------------
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    """A TOML scalar for a config value (``None`` -> ``""``; lists and mappings as a YAML/JSON string)."""
    if value is None:
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple | dict):
        return json.dumps(json.dumps(value))
    return json.dumps(str(value))


def app_config(cfg: RunConfig, settings: FlowerSettings | None = None) -> str:
    """The ``[tool.flwr.app.config]`` tables for ``cfg``: every run-config key (so that any can be overridden with
    ``--run-config``), the method's given hyper-parameters, and the deployment settings."""
    dumped = cfg.model_dump()
    tables = {name: dumped.pop(name) for name in ARG_TABLES}
    lines = ["[tool.flwr.app.config]"]
    lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in dumped.items()]
    for name, args in tables.items():
        lines += ["", f"[tool.flwr.app.config.{name}]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in args.items()]
    lines += ["", f"[tool.flwr.app.config.{ENGINE}]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in (settings or FlowerSettings()).model_dump().items()]
    return "\n".join(lines) + "\n"


def run_config(cfg: RunConfig, settings: FlowerSettings | None = None) -> dict[str, Any]:
    """The flat ``context.run_config`` Flower gives the apps of an app folder written for ``cfg`` (its
    ``[tool.flwr.app.config]``, nested tables joined with ``.``, as flwr flattens them)."""
    import tomllib

    def flat(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in table.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    return flat(tomllib.loads(app_config(cfg, settings))["tool"]["flwr"]["app"]["config"])


def project_name(folder: Path) -> str:
    """A package-safe project name from the app folder's name."""
    name = re.sub(r"[^a-z0-9]+", "-", folder.resolve().name.lower()).strip("-")
    return name if name and name[0].isalpha() else f"fedskew-{name or 'app'}"


def pyproject(cfg: RunConfig, name: str, settings: FlowerSettings | None = None) -> str:
    """A complete Flower app ``pyproject.toml`` whose components are fedskew's ServerApp and ClientApp."""
    return f"""# A Flower app running fedskew's {cfg.method} (written by `fedskew flower new`; see docs/flower.md).
# Every machine needs fedskew with its Flower extra installed (pip install "fedskew[flower]") and, for the clients,
# the dataset files; the SuperLink must run with --disable-runtime-dependency-installation (or let uv install these).
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{name}"
version = "1.0.0"
description = "fedskew {cfg.method} on {cfg.dataset} ({cfg.partition}, {cfg.clients} clients)"
license = "MIT"
dependencies = ["{FLOWER_SPEC}"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedskew"

[tool.flwr.app.components]
serverapp = "{SERVER_APP}"
clientapp = "{CLIENT_APP}"

{app_config(cfg, settings)}"""


def write_app(
    folder: Path, cfg: RunConfig, settings: FlowerSettings | None = None, simulation: str | None = None
) -> list[Path]:
    """Write a ready-to-run Flower app for ``cfg`` into ``folder`` (created; an existing ``pyproject.toml`` is never
    replaced). ``simulation``: a local-simulation connection block (``flower.simulation.connection``), written as
    ``simulation.toml``. Returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "pyproject.toml"
    if target.exists():
        raise ConfigError(f"{target} exists; fedskew never replaces it (choose an empty folder)")
    target.write_text(pyproject(cfg, project_name(folder), settings))
    readme = folder / "README.md"
    written = [target]
    if simulation is not None:
        sim = folder / "simulation.toml"
        sim.write_text(
            "# Flower's Simulation Engine: one simulated SuperNode per client (partition-id = client id).\n"
            "# Run it with `fedskew flower simulate .`, or add this block to $FLWR_HOME/config.toml and\n"
            "# `flwr run . local-simulation --stream` (then stop the local SuperLink flwr leaves running).\n"
            + simulation
        )
        written.append(sim)
    if not readme.exists():
        readme.write_text(
            f"# fedskew {cfg.method} on Flower\n\n"
            "Run it on a SuperLink (see fedskew's docs/flower.md):\n\n"
            "    flwr run . <connection> --stream --run-config \"out='/abs/run/dir'\"\n\n"
            "Each SuperNode: `flower-supernode --superlink HOST:PORT --node-config \"cid=K data-dir='/path'\"`,\n"
            f"K = 0..{cfg.clients - 1}, each id on exactly one node.\n"
        )
        written.append(readme)
    return written
