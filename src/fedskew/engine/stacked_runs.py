"""Several runs as rows of one stacked computation (issue 47): the seeds of one experiment share every shape, so their
rounds' clients can be trained by one batched step instead of one per run.

Each run keeps everything of its own (its thread, its :func:`~fedskew.runner.run_experiment`, run directory,
checkpoints, sampling, server and evaluation); only the client training meets. A run's batched trainer is a
:class:`Rendezvous` seat: at each round a run hands over its jobs and waits; when every run still running has handed
over (or left), one thread trains all the jobs together through :func:`~fedskew.engine.batched.train_batched` on a
:class:`StackedRuns` host, which numbers the runs' clients one after the other and gives each client its own run's
seed, data and state, and every run gets its uploads back in its own order and numbering. The results are those of
each run trained alone with ``--batched-clients``, to float32 rounding (``tests/test_stacked_runs.py``).

Runs whose server sends a broadcast (SCAFFOLD's control variate, FedProto's prototypes) differ in what their clients
receive beside the model: each client gets its own run's (``train_batched``'s ``sent``), which a batched form reads
per client (SCAFFOLD's shift), so such runs still share a step; a form that builds a piece once for the round from
the first client's context (a loss term, FedGen's generated inputs) would read one run's broadcast for all, and
those runs' jobs are trained per run, still at the rendezvous. A run whose method has no batched form trains its
clients itself (it leaves the rendezvous at its start).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fedskew.client.local import batched_form
from fedskew.engine.backends import conv_form
from fedskew.engine.batched import train_batched
from fedskew.engine.captured import PaddedCache, capture_refusal
from fedskew.protocol import Params, Upload

if TYPE_CHECKING:
    from fedskew.config import RunConfig
    from fedskew.engine.host import ClientHost, TrainJob
    from fedskew.engine.loop import Simulation
    from fedskew.runner import RunOutcome


class _Clients(Sequence):
    def __init__(self, runs: StackedRuns) -> None:
        self.runs = runs

    def __len__(self) -> int:
        return self.runs.offsets[-1]

    def __getitem__(self, cid: int) -> Any:  # type: ignore[override]
        r, local = self.runs.locate(cid)
        return self.runs.hosts[r].data.clients[local]


class _States(MutableMapping):
    def __init__(self, runs: StackedRuns) -> None:
        self.runs = runs

    def _at(self, cid: int) -> tuple[MutableMapping, int]:
        r, local = self.runs.locate(cid)
        return self.runs.hosts[r].client_states, local

    def __getitem__(self, cid: int) -> dict[str, Any]:
        states, local = self._at(cid)
        return states[local]

    def __setitem__(self, cid: int, value: dict[str, Any]) -> None:
        states, local = self._at(cid)
        states[local] = value

    def __delitem__(self, cid: int) -> None:
        states, local = self._at(cid)
        del states[local]

    def __iter__(self) -> Iterator[int]:
        for r, host in enumerate(self.runs.hosts):
            yield from (self.runs.offsets[r] + c for c in host.client_states)

    def __len__(self) -> int:
        return sum(len(h.client_states) for h in self.runs.hosts)


class _Data:
    def __init__(self, runs: StackedRuns) -> None:
        self.clients = _Clients(runs)
        self.num_classes = runs.hosts[0].data.num_classes


class StackedRuns:
    """The clients of several runs as one host for :func:`~fedskew.engine.batched.train_batched`: run ``r``'s client
    ``c`` is client ``offsets[r] + c``; the method, the reusable model and the training settings are the first
    run's (the runs share them: the same configuration but for the seed)."""

    def __init__(self, hosts: Sequence[ClientHost]) -> None:
        self.hosts = list(hosts)
        first = self.hosts[0]
        self.cfg, self.method, self.model, self.settings = first.cfg, first.method, first.model, first.settings
        self.offsets = [0]
        for h in self.hosts:
            self.offsets.append(self.offsets[-1] + len(h.data.clients))
        self.data = _Data(self)
        self.client_states = _States(self)

    def locate(self, cid: int) -> tuple[int, int]:
        for r in range(len(self.hosts)):
            if cid < self.offsets[r + 1]:
                return r, cid - self.offsets[r]
        raise IndexError(f"client {cid} is beyond the {self.offsets[-1]} clients of the stacked runs")

    def seed_of(self, cid: int) -> int:
        return int(self.hosts[self.locate(cid)[0]].cfg.seed)

    def cid_in_run(self, cid: int) -> int:
        return self.locate(cid)[1]


def _captures(hosts: list[ClientHost]) -> bool:
    """Whether the stacked runs' steps run at padded shapes: every run asks for it (``capture_steps``) and
    :func:`~fedskew.engine.captured.capture_refusal` lets them (the runs share their method and model)."""
    if not all(getattr(getattr(h, "cfg", None), "capture_steps", False) for h in hosts):
        return False
    form = batched_form(hosts[0].method.client)
    return not isinstance(form, str) and capture_refusal(form, hosts[0].model) is None


def _reads_per_client(host: ClientHost) -> bool:
    """Whether the host's batched form reads what a client is sent only per client (a shift, a pull, a logit map, its
    own ``begin`` and ``end``), so that runs sending different broadcasts can share a step; not when it builds a
    piece once for the round from the first client's context (a loss term, generated inputs)."""
    form = batched_form(host.method.client)
    if isinstance(form, str):
        return False
    return form.term is None and form.generated is None and form.client_term is None


def train_together(
    batch: dict[int, tuple[ClientHost, int, list[TrainJob]]], cache: PaddedCache | None = None
) -> dict[int, list[Upload]]:
    """Every run's jobs of the round (``batch[r] = (host, round, jobs)``), trained as one batched step where the runs
    share a round and either send no broadcast or have a batched form that reads it per client (each client gets its
    own run's), else per run; each run's uploads in its own order and numbering. ``cache``:
    where steps at padded shapes (``capture_steps``) keep their buffers and CUDA graphs from one meeting to the next
    (``None``: a new one each time)."""

    def capture(hosts: list[ClientHost]) -> bool | PaddedCache:
        return _captures(hosts) and (cache if cache is not None else True)

    def conv(hosts: list[ClientHost]) -> str:  # the runs' stacked convolutions (one experiment's: one form)
        return conv_form(getattr(hosts[0], "cfg", None), hosts[0].model)

    out: dict[int, list[Upload]] = {}
    together: dict[int, list[int]] = {}  # round -> runs
    for r, (host, rnd, jobs) in batch.items():
        if not jobs:
            out[r] = []
        elif any(sent for _, _, sent in jobs) and not _reads_per_client(host):  # its broadcast read once: alone
            received = {c: p for c, p, _ in jobs}
            sent = {c: own for c, _, own in jobs}
            cids = [c for c, _, _ in jobs]
            out[r] = train_batched(
                host, rnd, cids, received, jobs[0][2], capture=capture([host]), sent=sent, conv=conv([host])
            )
        else:
            together.setdefault(rnd, []).append(r)
    for rnd, runs in together.items():
        stacked = StackedRuns([batch[r][0] for r in runs])
        cids: list[int] = []
        received: dict[int, Params] = {}
        sent: dict[int, Params] = {}
        for i, r in enumerate(runs):
            for cid, params, own in batch[r][2]:
                cids.append(stacked.offsets[i] + cid)
                received[cids[-1]], sent[cids[-1]] = params, own
        hosts = [batch[r][0] for r in runs]
        uploads = train_batched(stacked, rnd, cids, received, {}, capture=capture(hosts), sent=sent, conv=conv(hosts))
        for i, r in enumerate(runs):
            start, n = stacked.offsets[i], len(batch[r][2])
            mine = [u for u in uploads if start <= u.cid < stacked.offsets[i + 1]]
            assert len(mine) == n
            out[r] = [replace(u, cid=u.cid - start) for u in mine]
    return out


class Rendezvous:
    """Where ``runs`` runs' client training meets, round by round (module docstring)."""

    def __init__(self, runs: int) -> None:
        self._cond = threading.Condition()
        self._active = set(range(runs))
        self._waiting: dict[int, tuple[ClientHost, int, list[TrainJob]]] = {}
        self._done: dict[int, list[Upload] | BaseException] = {}
        self.meetings = 0  # the batched steps that trained more than one run's clients
        self.cache = PaddedCache()  # the padded steps' buffers and graphs, replayed meeting after meeting

    def seat(self, r: int) -> _Seat:
        return _Seat(self, r)

    def submit(self, r: int, host: ClientHost, rnd: int, jobs: Sequence[TrainJob]) -> list[Upload]:
        with self._cond:
            self._waiting[r] = (host, rnd, list(jobs))
            self._meet()
            while r not in self._done:
                self._cond.wait()
            out = self._done.pop(r)
        if isinstance(out, BaseException):
            raise out
        return out

    def leave(self, r: int) -> None:
        """Run ``r`` trains no more clients here (it ended, failed, or trains its clients itself)."""
        with self._cond:
            self._active.discard(r)
            self._meet()

    def _meet(self) -> None:  # holding the lock: train when every active run is waiting
        if not self._waiting or len(self._waiting) < len(self._active):
            return
        batch, self._waiting = self._waiting, {}
        try:
            results: dict[int, Any] = train_together(batch, self.cache)
            self.meetings += sum(len(b[2]) > 0 for b in batch.values()) > 1
        except BaseException as exc:  # every waiting run fails with it (each then leaves)
            results = dict.fromkeys(batch, exc)
        self._done.update(results)
        self._cond.notify_all()


class _Seat:
    """One run's batched trainer at a :class:`Rendezvous` (a ``ClientTrainer``)."""

    def __init__(self, rendezvous: Rendezvous, r: int) -> None:
        self.rendezvous, self.r = rendezvous, r

    def train(self, host: ClientHost, rnd: int, jobs: Sequence[TrainJob]) -> list[Upload]:
        return self.rendezvous.submit(self.r, host, rnd, jobs)

    def close(self) -> None:
        self.rendezvous.leave(self.r)


def run_stacked(
    cfgs: Sequence[RunConfig], on_note: Callable[[int, str], None] | None = None
) -> list[RunOutcome | BaseException]:
    """Run ``cfgs`` (one experiment's seeds: configurations equal but for the seed, the rounds and where the runs
    go) with their
    rounds' clients trained as rows of one stacked computation, each run in its own thread; every run's outcome, or
    the exception that ended it, in order. Each run is recorded as a ``--batched-clients`` run (its records are one,
    to float32 rounding)."""
    from fedskew.runner import run_experiment

    if not cfgs:
        return []
    base = experiment_key(cfgs[0])
    for cfg in cfgs[1:]:
        if experiment_key(cfg) != base:
            changed = sorted(k for k, v in experiment_key(cfg).items() if base.get(k) != v)
            raise ValueError(f"stacked runs must be one experiment's seeds; these differ in {', '.join(changed)}")
    cfgs = [cfg.model_copy(update={"batched_clients": True}) for cfg in cfgs]
    meeting = Rendezvous(len(cfgs))
    results: list[RunOutcome | BaseException | None] = [None] * len(cfgs)

    def one(r: int) -> None:
        def seat_in(sim: Simulation, first: int) -> None:
            if not sim.use_trainer(meeting.seat(r)):  # no batched form: it trains its clients itself
                meeting.leave(r)

        try:
            results[r] = run_experiment(
                cfgs[r], on_start=seat_in, on_note=None if on_note is None else (lambda msg: on_note(r, msg))
            )
        except BaseException as exc:  # reported with the others, not lost in the thread
            results[r] = exc
        finally:
            meeting.leave(r)

    run_in_threads([lambda r=r: one(r) for r in range(len(cfgs))])
    return [res if res is not None else RuntimeError("the run's thread ended without a result") for res in results]


def run_in_threads(bodies: Sequence[Callable[[], None]]) -> None:
    """Run each body (a run) in its own thread and wait for all. Called on the main thread, SIGINT and SIGTERM are
    passed on to the runs in those threads (:func:`fedskew.runner.stop_thread_runs`): each finishes its round,
    checkpoints and ends ``interrupted``, as a run on the main thread does."""
    from fedskew.runner import stop_thread_runs

    def forward(signum: int, frame: object) -> None:
        n = stop_thread_runs(signum)
        print(f"\n{signal.Signals(signum).name}: {n} stacked runs finish this round, then checkpoint", flush=True)

    on_main = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    threads = [threading.Thread(target=body, name=f"fedskew-stacked-{i}") for i, body in enumerate(bodies)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def experiment_key(cfg: RunConfig) -> dict[str, Any]:
    """What stacked runs must share: everything but what only says where and how long a run goes (the device
    too must be one)."""
    from fedskew.config import NOT_IDENTITY

    free = (NOT_IDENTITY - {"device"}) | {"rounds"}
    return {k: v for k, v in cfg.model_dump().items() if k not in free}


__all__ = ["Rendezvous", "StackedRuns", "experiment_key", "run_in_threads", "run_stacked", "train_together"]
