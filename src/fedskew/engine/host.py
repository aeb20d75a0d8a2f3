"""The narrow interface between the round loop and the ways it can train a round's clients.

The loop (:class:`fedskew.engine.loop.Simulation`) hands a round's clients to a :class:`ClientTrainer` -- forked worker
processes (``engine/workers.py``) or all clients at once, vmapped (``engine/batched.py``) -- and knows no more of
them than this protocol (it gets one from ``engine/backends.py``). A trainer, in turn, sees the simulation only as a
:class:`ClientHost`. Neither side imports the other's module, so the engine's modules import each other in one
direction only (tests/test_boundaries.py keeps it so).
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor, nn

from fedskew.protocol import Params, Upload

if TYPE_CHECKING:
    from fedskew.client.local import TrainSettings
    from fedskew.data.pools import FederatedData
    from fedskew.engine.rounds import RoundPlan, RoundResult
    from fedskew.methods import Method

EvalSource = str | tuple[str, int]  # an evaluation pass's samples (ClientHost.eval_tensors)
BatchScores = list[tuple[Tensor, Tensor]]  # one pass's per-batch scores (engine.evaluate.batch_scores)
TrainJob = tuple[int, Params, Params]  # (client id, the model it received, the server's broadcast)


class ClientHost(Protocol):
    """What a trainer reads of the simulation: the run, the federation, the method, the one reusable model, the
    clients' persistent states (a trainer advances them), and the sequential step it must reproduce."""

    cfg: Any  # the RunConfig
    data: FederatedData
    method: Method
    model: nn.Module
    settings: TrainSettings
    client_states: MutableMapping[int, dict[str, Any]]  # a dict, or a disk store's map (engine/state_store.py)

    def _train(self, cid: int, rnd: int, received: Params, broadcast: Params) -> Upload: ...

    def params_for(self, cid: int, base: Params | None = None) -> Params: ...

    def eval_tensors(self, source: EvalSource) -> tuple[Tensor, Tensor]: ...


class RoundHost(ClientHost, Protocol):
    """A host whose rounds can be driven from outside: open, take every upload, close (``Simulation``, through its
    round server, ``engine/round_server.py``)."""

    def open_round(self, rnd: int) -> RoundPlan: ...

    def sent_to(self, plan: RoundPlan, cid: int) -> Params: ...

    def take_upload(self, plan: RoundPlan, update: Upload, nonfinite_at: Sequence[int] | None = None) -> None: ...

    def close_round(self, plan: RoundPlan) -> RoundResult: ...


class ClientTrainer(Protocol):
    """Trains a round's clients for the loop: the uploads of ``jobs`` in their order, each client's state advanced in
    ``host.client_states`` as the sequential loop would."""

    def train(self, host: ClientHost, rnd: int, jobs: Sequence[TrainJob]) -> Iterable[Upload]: ...

    def close(self) -> None: ...


class ClientPool(ClientTrainer, Protocol):
    """A trainer that can also score evaluation passes (the worker processes): per ``(params, source)`` pass, the
    batch scores of the pass in one process, exactly."""

    def score(
        self, host: ClientHost, passes: Sequence[tuple[Params, EvalSource]], batch_size: int
    ) -> list[BatchScores]: ...
