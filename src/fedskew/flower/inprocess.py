"""A Flower ``Grid`` whose nodes are ClientApp calls in this process: the real apps, no network, no Ray.

:class:`InProcessGrid` implements ``flwr.serverapp.Grid``: every pushed ``Message`` is serialized and read back
(``deflate``/``inflate`` of its whole object tree, as the SuperLink stores it), handed to the ClientApp with that
node's own ``Context`` (its ``node_config``, and a ``state`` that persists across the run, as on a SuperNode), and the
reply (or the error the ClientApp raised, as Flower reports it) is serialized and read back too. Node ids are random,
as Flower's are, so nothing can rely on them. :func:`run_in_process` runs fedskew's ServerApp on it: the equivalence
test, and ``fedskew flower local``.

Building a ``Message`` outside a Flower process needs the process's task identity, which only flwr's runtime sets:
:func:`task_identity` sets it (``flwr.supercore.task_identity``, an internal API; the one place fedskew touches one).
"""

from __future__ import annotations

import contextlib
import math
import random
import traceback
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedskew.config import RunConfig
from fedskew.flower.settings import FlowerSettings, run_config
from fedskew.protocol import TIMING_KEYS


@contextlib.contextmanager
def task_identity(run_id: int, node_id: int, task_id: int = 1) -> Iterator[None]:
    """Set flwr's process task identity (needed to build instruction messages) for the block; restore it after."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, node_id, task_id
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def round_trip(msg: Message) -> Message:
    """``msg`` serialized and read back (every nested record and array), message id kept."""
    contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}
    out = cast(Message, inflate_object_from_contents(msg.object_id, contents))
    out.metadata.__dict__["_message_id"] = msg.metadata.message_id
    return out


class InProcessGrid(Grid):
    """Nodes that are ClientApp calls in this process (see the module docstring).

    ``node_configs``: one ``node_config`` per node (``{"cid": K}``). ``silent``: node indices that never reply (a
    dead node: its messages simply stay unanswered, and the ServerApp's bounded wait runs out)."""

    def __init__(
        self,
        client_app: ClientApp,
        node_configs: list[dict[str, Any]],
        run_config: Mapping[str, Any],
        *,
        run_id: int = 1,
        seed: int = 0,
    ) -> None:
        rng = random.Random(seed)
        self.client_app = client_app
        self.contexts: dict[int, Context] = {}
        for nc in node_configs:
            nid = rng.getrandbits(63) | 1
            self.contexts[nid] = Context(run_id, nid, dict(nc), RecordDict(), dict(run_config))
        self.silent: set[int] = set()  # node ids that never reply
        self.sent: list[Message] = []  # every instruction delivered (tests inspect the payloads)
        self.received: list[Message] = []  # every reply a client sent, as the server reads it (what leaves a client)
        self._replies: dict[str, Message] = {}
        self._run = Run.create_empty(run_id)

    def node_of(self, key: str, value: Any) -> int:
        """The node id whose node_config has ``key = value``."""
        return next(nid for nid, ctx in self.contexts.items() if ctx.node_config.get(key) == value)

    # ---- flwr.serverapp.Grid ------------------------------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return cast(Run, self._run)

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            ids.append(msg.metadata.message_id)
            nid = msg.metadata.dst_node_id
            if nid not in self.contexts or nid in self.silent:
                continue
            delivered = round_trip(msg)
            self.sent.append(delivered)
            try:
                reply = self.client_app(delivered, self.contexts[nid])
            except Exception as exc:  # as a SuperNode reports a ClientApp that raised
                reason = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
                reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=delivered)
            self._replies[msg.metadata.message_id] = round_trip(reply)
            self.received.append(self._replies[msg.metadata.message_id])
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(mid) for mid in list(message_ids) if mid in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


def record_differences(
    flower: list[dict[str, Any]], simulator: list[dict[str, Any]], tol: float = 1e-6
) -> tuple[float, list[str]]:
    """Compare two runs' ``metrics.jsonl`` records, every field but the wall-clock timings (:data:`TIMING_KEYS`,
    which legitimately differ): numbers within ``tol``, everything else equal. Returns the largest absolute
    difference of a number and the differing fields (``round 2: global_acc 0.61 != 0.62``)."""

    def leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
        if isinstance(value, dict):
            for k, v in value.items():
                if not (path == "" and k in TIMING_KEYS):
                    yield from leaves(v, f"{path}.{k}" if path else k)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                yield from leaves(v, f"{path}[{i}]")
        else:
            yield path, value

    worst, diffs = 0.0, []
    if len(flower) != len(simulator):
        diffs.append(f"{len(flower)} rounds != {len(simulator)}")
    for a, b in zip(flower, simulator, strict=False):
        la, lb = dict(leaves(a, "")), dict(leaves(b, ""))
        for key in sorted(set(la) | set(lb)):
            x, y = la.get(key, "<missing>"), lb.get(key, "<missing>")
            if all(isinstance(v, int | float) and not isinstance(v, bool) for v in (x, y)):
                fx, fy = float(x), float(y)
                both_nan = math.isnan(fx) and math.isnan(fy)
                gap = 0.0 if both_nan else abs(fx - fy) if not (math.isnan(fx) or math.isnan(fy)) else math.inf
                worst = max(worst, gap)
                if gap > tol:
                    diffs.append(f"round {b.get('round')}: {key} {x!r} != {y!r}")
            elif x != y:
                diffs.append(f"round {b.get('round')}: {key} {x!r} != {y!r}")
    return worst, diffs


def compare_with_simulator(cfg: RunConfig, folder: Path) -> tuple[float, list[str]]:
    """Run ``cfg`` with ``fedskew run``'s runner and with the Flower apps in process (run directories under
    ``folder``, no database) and compare their metrics (:func:`record_differences`)."""
    import json

    from fedskew.runner import run_experiment

    runs = {}
    for engine in ("simulator", "flower"):
        one = cfg.model_copy(update={"out": str(folder / engine), "db": None})
        run_experiment(one) if engine == "simulator" else run_in_process(one)
        lines = (folder / engine / "metrics.jsonl").read_text().splitlines()
        runs[engine] = [json.loads(line) for line in lines]
    return record_differences(runs["flower"], runs["simulator"])


def make_grid(
    cfg: RunConfig, settings: FlowerSettings | None = None, client_app: ClientApp | None = None, seed: int = 0
) -> InProcessGrid:
    """An in-process federation for ``cfg``: ``cfg.clients`` nodes ``cid=0..N-1`` running fedskew's ClientApp,
    every context holding the run config an app folder written for ``cfg`` would give (:func:`run_config`)."""
    if client_app is None:
        from fedskew.flower.client_app import app as client_app
    nodes = [{"cid": c} for c in range(cfg.clients)]
    return InProcessGrid(client_app, nodes, run_config(cfg, settings), seed=seed)


def run_in_process(
    cfg: RunConfig,
    settings: FlowerSettings | None = None,
    *,
    grid: InProcessGrid | None = None,
    server_app: ServerApp | None = None,
) -> Path:
    """Run fedskew's ServerApp (``server_app``, default the real one) against an in-process federation; return
    the run directory (``cfg.out``, which must be set)."""
    if not cfg.out:
        raise ValueError("run_in_process needs cfg.out: the run directory the ServerApp writes")
    if server_app is None:
        from fedskew.flower.server_app import app as server_app
    grid = grid or make_grid(cfg, settings)
    context = Context(1, SUPERLINK_NODE_ID, {}, RecordDict(), run_config(cfg, settings))
    with task_identity(run_id=1, node_id=SUPERLINK_NODE_ID):
        server_app(grid, context)
    return Path(cfg.out)
