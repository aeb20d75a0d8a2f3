"""fedskew's tensors in Flower records, bit for bit.

* :func:`to_record` / :func:`from_record`: a state dict (``Params``) <-> ``ArrayRecord`` (one ``Array`` per tensor,
  names, order, shapes and dtypes kept; boolean masks stay boolean);
* :func:`save_state` / :func:`load_state`: a client's persistent state (``client_state``: control variates, MOON's
  previous model, personal models, local heads, ...) and the model its ``trained`` view evaluates <->
  the ClientApp's ``context.state``. Every ``dict[str, Tensor]`` entry becomes an ``ArrayRecord`` of its own; any other
  value is kept as ``torch.save`` bytes in one ``ConfigRecord`` and read back with ``weights_only=True`` (tensors,
  numbers, strings, lists and dicts only: no code is ever unpickled).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import Tensor

from fedskew.protocol import Params

STATE_PREFIX = "fedskew.state/"  # context.state records fedskew owns: one ArrayRecord per state-dict entry
STATE_MISC = "fedskew.state"  # ConfigRecord: the entries that are not state dicts, as torch.save bytes
TRAINED = "fedskew.trained"  # ArrayRecord: the model the client's `trained` view evaluates (personalized methods)


def to_record(params: Mapping[str, Tensor]) -> ArrayRecord:
    """A state dict as an ``ArrayRecord`` (CPU numpy copies; exact)."""
    return ArrayRecord({k: Array(t.detach().cpu().contiguous().numpy()) for k, t in params.items()})


def from_record(record: ArrayRecord, device: torch.device | str = "cpu") -> Params:
    """An ``ArrayRecord`` as a state dict of tensors on ``device``."""
    return {k: torch.from_numpy(np.array(a.numpy(), copy=True)).to(device) for k, a in record.items()}


def _is_params(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in value.items())
    )


def save_state(state: RecordDict, client_state: Mapping[str, Any], trained: Params | None) -> None:
    """Write a client's persistent state into ``context.state`` (replacing what fedskew wrote there before)."""
    for name in [n for n in state if n.startswith(STATE_PREFIX) or n in (STATE_MISC, TRAINED)]:
        del state[name]
    misc: dict[str, bytes] = {}
    for key, value in client_state.items():
        if _is_params(value):
            state[STATE_PREFIX + key] = to_record(value)
        else:
            buf = io.BytesIO()
            torch.save(value, buf)
            misc[key] = buf.getvalue()
    state[STATE_MISC] = ConfigRecord(misc)
    if trained is not None:
        state[TRAINED] = to_record(trained)


def load_state(state: RecordDict, device: torch.device | str = "cpu") -> tuple[dict[str, Any], Params | None]:
    """A client's persistent state and its ``trained`` model from ``context.state`` (``{}``, ``None`` at first)."""
    client_state: dict[str, Any] = {}
    for name in state:
        if name.startswith(STATE_PREFIX):
            client_state[name[len(STATE_PREFIX) :]] = from_record(state[name], device)  # type: ignore[arg-type]
    if STATE_MISC in state:
        for key, blob in state[STATE_MISC].items():  # type: ignore[union-attr]
            client_state[key] = torch.load(io.BytesIO(blob), map_location=device, weights_only=True)  # type: ignore[arg-type]
    trained = from_record(state[TRAINED], device) if TRAINED in state else None  # type: ignore[arg-type]
    return client_state, trained


def metrics_record(values: Mapping[str, float | int | list[int]]) -> MetricRecord:
    """Scalar metrics (and integer lists: label histograms) as a ``MetricRecord``."""
    return MetricRecord({k: (list(map(int, v)) if isinstance(v, list) else v) for k, v in values.items()})
