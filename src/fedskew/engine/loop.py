"""The one round loop. Methods plug into it; none copies it.

One round, as a reader should see it::

    sampled = sample(round) - dropped_out(round)       # both seeded by (seed, round), independent streams
    for cid in sampled:
        received = personal[cid] or global             # what this client gets (+ the server half's broadcast)
        upload   = local_train(method.client, ...)     # one reusable model, resident tensors, seeded order
        stack.add(upload)                              # validated into preallocated [K, ...] buffers (or rejected)
    rin      = stack.round_input()                     # on_bad_update: fail raises, drop aggregates the rest
    half     = method.server_half.advance(rin, half)   # the client part's server side (SCAFFOLD's c)
    server   = method.server.aggregate(rin, state)     # masks -> weights -> combine -> step, or personalized
    evaluate(global / global_local / personal views)   # on the eval cadence
    record   -> metrics.jsonl, SQLite, progress bar
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.client.local import snapshot
from fedskew.config import RunConfig
from fedskew.data.pools import FederatedData
from fedskew.engine.backends import batched_trainer, warn_unbatched, worker_pool
from fedskew.engine.buffers import TrainInPlace
from fedskew.engine.calibration import calibrated_model
from fedskew.engine.evaluate import (
    ClientScores,
    accumulate,
    batch_scores,
    eval_batch_of,
    global_views,
    pooled,
    same_samples,
    summarize,
)
from fedskew.engine.host import ClientPool, ClientTrainer, EvalSource
from fedskew.engine.model_init import (
    LOCAL_GROUPS,
    UserModel,
    init_model,
    kept_local,
    local_state_names,
    resolve_model_name,
    user_model_name,
)
from fedskew.engine.round_server import RoundServer, server_context
from fedskew.engine.rounds import (
    LOCAL_PARAMS,
    Diverged,
    RoundPlan,
    RoundResult,
    UpdateClip,
    dropped_out,
    keep_trained,
    payload_bytes,
    personalized,
    sample_clients,
    train_client,
    train_settings,
    with_local,
)
from fedskew.engine.state_store import MAPS, open_state_store, peek, peek_entry
from fedskew.methods import Method, resolve_method
from fedskew.privacy.server import noised_entries
from fedskew.protocol import Params, Upload
from fedskew.server.api import CalibrationKey
from fedskew.server.uploads import UploadStack, nonfinite_each

# the round's and the model's parts, importable from here as before they moved out (engine/rounds.py, model_init.py)
__all__ = [
    "LOCAL_GROUPS",
    "Diverged",
    "EvalSource",
    "RoundPlan",
    "RoundResult",
    "Simulation",
    "UserModel",
    "dropped_out",
    "global_views",
    "init_model",
    "keep_trained",
    "local_state_names",
    "payload_bytes",
    "resolve_model_name",
    "sample_clients",
    "train_client",
    "train_settings",
    "user_model_name",
    "with_local",
]


EVAL_CHUNK = 64  # per-client evaluation: clients whose models are scored together (held in RAM at once)


def _copied(params: Params) -> Params:
    """What a client keeps of a live upload (the model's own tensors, :func:`train_client`'s ``live``): a copy."""
    return {k: v.clone() for k, v in params.items()}


def _validation_union(data: FederatedData) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Every client's validation split together, with the owner of each sample; None without validation splits."""
    if not data.clients or any(c.x_val is None or c.y_val is None for c in data.clients):
        return None
    xs = [c.x_val for c in data.clients]
    ys = [c.y_val for c in data.clients]
    owner = torch.cat([torch.full((len(y),), c.cid, dtype=torch.long) for c, y in zip(data.clients, ys, strict=True)])
    return torch.cat(xs), torch.cat(ys), owner.to(ys[0].device)  # type: ignore[arg-type]


class Simulation:
    """A seeded, single-process simulation of one federation: the clients, trained here, and the round server
    (:class:`~fedskew.engine.round_server.RoundServer`, shared with the Flower ServerApp) that aggregates them."""

    def __init__(
        self,
        cfg: RunConfig,
        data: FederatedData,
        method: Method | None = None,
        model: UserModel | None = None,
        *,
        state_dir: Path | None = None,
        owner: str = "",
    ) -> None:
        """``state_dir``: where a disk-backed client-state store lives (``cfg.state_store``; the runner passes
        ``<run dir>/client_state``, default a temporary directory); ``owner``: the run, for its marker."""
        self.cfg = cfg
        self.data = data
        self.method = method or resolve_method(cfg.method, cfg.method_args)
        self.model = init_model(cfg, data, self.method, model)
        self._in_place = TrainInPlace(self.model)  # the sequential loop trains in the upload stack's rows
        template = snapshot(self.model)
        trainable = frozenset(n for n, p in self.model.named_parameters() if p.requires_grad)
        self.settings = train_settings(cfg)
        self.local_names = kept_local(cfg, self.method, self.model, trainable)
        # a client that has not trained yet holds the initial model's entries, not the average
        initial = {k: template[k] for k in self.local_names}
        self._initial_local = initial  # what a held-out client holds of its own before it ever trains
        # the per-client maps, in RAM or on disk (engine/state_store.py): client_states (each client's persistent
        # state), personal (the models the server sent: personalized strategies), trained (personalized methods:
        # each client's model after its latest training)
        self.state_store = open_state_store(
            cfg,
            self.method,
            template,
            data.num_clients,
            default_state=(lambda: {LOCAL_PARAMS: initial}) if initial else dict,
            directory=state_dir,
            owner=owner,
        )
        self.client_states: MutableMapping[int, dict[str, Any]]
        self.trained: MutableMapping[int, Params]
        self.eval_batch = eval_batch_of(cfg.eval_batch_size, self.model, data.x_test)
        # the global test set is the clients' test splits together (protocol pfllib): score it once, as theirs
        self.global_is_local_union = same_samples(data)
        # the clients' validation splits, scored beside the test data at every evaluated round (validation_select):
        # the round a validation-selected statistic picks (results/store.py summarize_run)
        self.validation = _validation_union(data) if cfg.validation_select else None
        # user-level DP: each client's update clipped over every floating entry that travels
        self.dp_clip = (
            UpdateClip(cfg.dp_clip, noised_entries(template, self.local_names), cfg.dp_extras_scale)
            if cfg.dp_clip is not None
            else None
        )
        self.server = RoundServer(
            cfg.round_settings(),
            self.method,
            server_context(data, self.method, template, trainable, cfg.seed),
            local_names=self.local_names,
            personal=self.state_store.maps["personal"],
            scratch=None if state_dir is None else state_dir.parent,  # the run directory
        )
        self.bind_states(self.state_store.maps)
        self.current_round = 0  # the round opened last (a personalization's draws are keyed by it)
        self._workers: ClientPool | None = None  # forked at the first round that uses them (cfg.workers > 1)
        # batched_clients: warned once, and trained one after the other, when the method or model cannot be batched
        self._batched: ClientTrainer | None = batched_trainer(self) if cfg.batched_clients else None
        if not cfg.batched_clients:
            warn_unbatched(cfg)
        self.batched = self._batched is not None

    def bind_states(self, maps: Mapping[str, MutableMapping[int, Any]]) -> None:
        """Use these per-client maps (the store's, after a restore)."""
        self.client_states, self.server.personal, self.trained = (maps[name] for name in MAPS)

    # the server's state, read (and, for the global model, set) through the simulation as well
    @property
    def global_params(self) -> Params:
        return self.server.global_params

    @global_params.setter
    def global_params(self, params: Params) -> None:
        self.server.global_params = params

    @property
    def personal(self) -> MutableMapping[int, Params]:
        return self.server.personal

    @property
    def server_state(self) -> Any:
        return self.server.server_state

    @property
    def server_half_state(self) -> Any:
        return self.server.server_half_state

    @property
    def trainable(self) -> frozenset[str]:
        return self.server.trainable

    @property
    def model_name(self) -> str:
        return resolve_model_name(self.cfg, self.data, self.method)

    # ---- one round ---------------------------------------------------------------------------------------
    def round(self, rnd: int) -> RoundResult:
        plan = self.open_round(rnd)
        reporting = [cid for cid in plan.sampled if cid not in plan.gone]  # drop-outs: no training, no state change
        # each upload is validated into preallocated [K, ...] buffers as soon as it is trained, then dropped;
        # batched clients arrive together: their finiteness is checked at once (one device sync, not one each)
        uploads = self._train_clients(plan, reporting)
        if self._batched is not None:
            trained = list(uploads)
            for upload, bad in zip(trained, nonfinite_each(trained), strict=True):
                self.take_upload(plan, upload, bad)
        else:
            for upload in uploads:
                self.take_upload(plan, upload)
        return self.close_round(plan)

    def _train_clients(self, plan: RoundPlan, cids: list[int]) -> Iterator[Upload]:
        """The uploads of ``cids``, in that order: trained one after the other, in ``workers`` forked processes
        (``engine/workers.py``: identical results), or together, vmapped (``batched_clients``, ``engine/batched.py``:
        equal up to float32 rounding); the loop knows the last two only as ``ClientTrainer`` (``engine/host.py``).
        Each client gets its model and what the round server sends it beside it (``sent_to``)."""
        rnd = plan.rnd
        if self._batched is not None:
            jobs = [(cid, self.params_for(cid), self.sent_to(plan, cid)) for cid in cids]
            yield from self._batched.train(self, rnd, jobs)
        elif self.cfg.workers > 1 and len(cids) > 1:
            if self._workers is None:
                self._workers = worker_pool(self, min(self.cfg.workers, self.data.num_clients))
            jobs = [(cid, self.params_for(cid), self.sent_to(plan, cid)) for cid in cids]
            yield from self._workers.train(self, rnd, jobs)
        else:
            # live: the upload's params are the model's tensors, which take_upload copies before the next trains;
            # with the round's stack in RAM, the model trains in the stack's next row and nothing is copied
            stack = plan.stack if isinstance(plan.stack, UploadStack) and not self.server.on_disk else None
            for cid in cids:
                if stack is not None:
                    self._in_place.bind(stack.next_row())
                try:
                    upload = self._train(cid, rnd, self.params_for(cid), self.sent_to(plan, cid), live=True)
                finally:
                    self._in_place.restore()  # before anything else uses the model (it would write the row)
                yield upload

    def use_trainer(self, trainer: ClientTrainer) -> bool:
        """Train the batched clients with ``trainer`` (a seat of several runs' stacked training,
        ``engine/stacked_runs.py``); ``False``, and nothing changed, when this run's clients cannot be batched."""
        if self._batched is None:
            return False
        self._batched = trainer
        return True

    def close(self) -> None:
        """Stop the worker processes, if any, and release the batched trainer (the runner calls it when the run
        ends, however it ends)."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None
        if self._batched is not None:
            self._batched.close()
        self.state_store.close()

    def open_round(self, rnd: int) -> RoundPlan:
        """Start round ``rnd`` on the round server (:meth:`~fedskew.engine.round_server.RoundServer.open_round`)."""
        self.current_round = rnd
        return self.server.open_round(rnd)

    def sent_to(self, plan: RoundPlan, cid: int) -> Params:
        """What client ``cid`` is sent beside its model this round (the round server's
        :meth:`~fedskew.engine.round_server.RoundServer.sent_to`: the broadcast, and its own downloads)."""
        return self.server.sent_to(plan, cid)

    def take_upload(self, plan: RoundPlan, upload: Upload, nonfinite_at: Sequence[int] | None = None) -> None:
        """Hand one client's upload to the round server (``nonfinite_at``: its finiteness, already found); the
        client keeps what it trained (unless the server rejected a mis-shaped upload: docs/guide.md) and its state
        goes back to the store."""
        rejected = self.server.take_upload(plan, upload, nonfinite_at)
        if rejected is None or rejected.nonfinite:  # the client holds the model it trained (docs/guide.md)
            self._keep_trained(upload.cid, upload)
        self.state_store.release(upload.cid)  # this round is done with the client's state: to disk (a disk store)

    def close_round(self, plan: RoundPlan) -> RoundResult:
        """Aggregate, evaluate this simulation's views on the cadence, record (the round server's
        :meth:`~fedskew.engine.round_server.RoundServer.close_round`); a disk store writes the round's client state
        (personalized models) before the views are scored."""
        return self.server.close_round(plan, self.evaluate, commit=self.state_store.commit)

    def _train(self, cid: int, rnd: int, received: Params, broadcast: Params, live: bool = False) -> Upload:
        """Client ``cid``'s local training in round ``rnd`` (its persistent state advances in ``client_states``);
        ``live``: the upload's params are the model's own tensors, valid until the next client trains."""
        client = self.data.clients[cid]
        state = self.client_states[cid]
        args = (self.method, self.model, self.settings, self.cfg.seed, cid, rnd, received, broadcast, state)
        x, y = client.x_train, client.y_train
        return train_client(*args, x, y, client.x_val, client.y_val, self.dp_clip, client.input_noise, live=live)

    def _keep_trained(self, cid: int, upload: Upload) -> None:
        """What the client keeps of the model it trained: its local entries and, for personalized methods, the
        model the ``trained`` view evaluates (:func:`keep_trained`)."""
        state = self.client_states[cid]
        rnd = self.current_round
        tune = lambda p: self._personalized(cid, rnd, p)  # noqa: E731
        trained = keep_trained(self.method, self.local_names, state, upload, tune, retain=_copied)
        if trained is not None:
            self.trained[cid] = trained

    def params_for(self, cid: int, base: Params | None = None) -> Params:
        """The model client ``cid`` holds after receiving ``base`` (default: what the server sends it, its personal
        or the global model), with the state-dict entries it keeps for itself (``method.local``) overlaid."""
        params = base if base is not None else self.server.received(cid)
        own = peek_entry(self.client_states, cid, LOCAL_PARAMS)
        return {**params, **own} if own else params

    def personal_params(self, cid: int, rnd: int | None = None) -> Params:
        """Client ``cid``'s personalized model now, i.e. after aggregation (of round ``rnd``, default the round
        server's latest): the model it keeps for itself (Ditto, FedAMP) or else what it would start its next round
        from (FedCAC's customized model, or the global model with its local entries for FedPer/FedRep/FedBN/Local),
        through its client part's personalization (FedRoD's personal head, Per-FedAvg's adaptation step)."""
        state = peek(self.client_states, cid)
        own = self.method.client.personal_model(state)
        if own is not None:
            return own
        return self._personalized(cid, self.current_round if rnd is None else rnd, self.params_for(cid), state)

    def _personalized(self, cid: int, rnd: int, base: Params, state: dict[str, Any] | None = None) -> Params:
        client = self.data.clients[cid]
        state = peek(self.client_states, cid) if state is None else state
        args = (self.method, self.model, self.settings, self.cfg.seed, cid, rnd, base, state)
        return personalized(*args, client.x_train, client.y_train)

    def trained_params(self, cid: int) -> Params:
        """Client ``cid``'s model right after its latest local training (before aggregation); a client that has not
        trained yet holds its personalized model."""
        return self.trained.get(cid) or self.personal_params(cid)

    # ---- evaluation views --------------------------------------------------------------------------------
    def eval_tensors(self, source: EvalSource) -> tuple[torch.Tensor, torch.Tensor]:
        """The test samples of an evaluation pass: ``"local"`` (every client's test split, in client order),
        ``"test"`` (the global test set) or ``("client", cid)``."""
        if source == "local":
            return self.data.local_x, self.data.local_y
        if source == "test":
            return self.data.x_test, self.data.y_test
        if source == "val":
            assert self.validation is not None
            return self.validation[0], self.validation[1]
        c = self.data.clients[source[1]]
        if source[0] == "val":
            assert c.x_val is not None and c.y_val is not None
            return c.x_val, c.y_val
        return c.x_test, c.y_test

    def batch_scores_of(self, passes: list[tuple[Params, EvalSource]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per ``(params, source)`` pass, its :func:`~fedskew.engine.evaluate.batch_scores`: in the worker processes
        when there are any (split into ranges of whole batches: the same numbers), else here."""
        if self._workers is not None:
            return self._workers.score(self, passes, self.eval_batch)
        out = []
        for params, source in passes:
            self.model.load_state_dict(params)
            out.append(batch_scores(self.model, *self.eval_tensors(source), self.eval_batch))
        return out

    def _per_client_scores(
        self, params_of: Callable[[int], Params], cids: list[int] | None = None, split: str = "client"
    ) -> ClientScores:
        """Each client's model (of ``cids``, default all; the others count 0 samples, so no statistic sees them) on
        its test split (``split="val"``: its validation split), ``EVAL_CHUNK`` clients' models in RAM at a time (a
        disk store reads them one by one)."""
        data = self.data
        correct, loss, count = (np.zeros(data.num_clients) for _ in range(3))
        clients = data.clients if cids is None else [data.clients[c] for c in cids]
        for i in range(0, len(clients), EVAL_CHUNK):
            chunk = clients[i : i + EVAL_CHUNK]
            passes: list[tuple[Params, EvalSource]] = [(params_of(c.cid), (split, c.cid)) for c in chunk]
            for c, batches in zip(chunk, self.batch_scores_of(passes), strict=True):
                n = self.eval_tensors((split, c.cid))[1].shape[0]
                owner = torch.zeros(n, dtype=torch.long, device=c.y_train.device)
                s = accumulate(batches, owner, 1)
                correct[c.cid], loss[c.cid], count[c.cid] = s.correct[0], s.loss_sum[0], s.count[0]
        return ClientScores(correct, loss, count)

    def evaluate(self, rnd: int | None = None) -> tuple[dict[str, Any], dict[str, ClientScores]]:
        """Every view once: each distinct (model, sample) pair is scored at most once. Views of per-client models
        score the clients of the round server's ``eval_sample`` (``rnd``; default all), and the record says how many."""
        data = self.data
        sample = None if rnd is None else self.server.eval_sample(rnd)
        glob = self.evaluated_model(rnd)
        rec: dict[str, Any] = global_views(self, glob)
        if sample is not None and (self.local_names or self.method.personalized):
            rec["eval_clients"] = len(sample)
        if self.local_names:  # each client evaluates the global model with the entries it keeps locally
            scores = {
                "global_local": self._per_client_scores(lambda cid: self.params_for(cid, self.global_params), sample)
            }
        else:  # one pass over all clients' test sets
            (batches,) = self.batch_scores_of([(glob, "local")])
            scores = {"global_local": accumulate(batches, data.local_owner, data.num_clients)}
            if self.global_is_local_union and not data.domains:
                rec.update(pooled("global", scores["global_local"]))
        rec.update(summarize("global_local", scores["global_local"]))
        if self.method.personalized:
            scores["personal"] = self._per_client_scores(lambda cid: self.personal_params(cid, rnd), sample)
            scores["trained"] = self._per_client_scores(self.trained_params, sample)
            rec.update(summarize("personal", scores["personal"]))
            rec.update(summarize("trained", scores["trained"]))
        if data.heldout:  # clients that never train: the global model, and what their client part makes of it
            rec.update(self._heldout_views(rnd))
        if self.validation is not None:  # the same models on the validation splits: what selects a round
            (batches,) = self.batch_scores_of([(glob, "val")])
            rec.update(pooled("val_global", accumulate(batches, self.validation[2], data.num_clients)))
            if self.method.personalized:
                val = self._per_client_scores(lambda cid: self.personal_params(cid, rnd), sample, "val")
                rec.update(pooled("val_personal", val))
        return rec, scores

    def _heldout_views(self, rnd: int | None) -> dict[str, float]:
        """The held-out clients (``heldout_clients``; PFLlib's new clients), each on its test split: the global model
        (``heldout_*``) and, for a personalized method, the personalized model its client part makes in one local
        round from the global model with a fresh client state (``heldout_adapted_*``; discarded after scoring, so
        nothing of a held-out client ever reaches the federation)."""
        data, rnd = self.data, rnd or self.current_round
        n = len(data.heldout)
        views = ("heldout", "heldout_adapted") if self.method.personalized else ("heldout",)
        sums = {v: (np.zeros(n), np.zeros(n), np.zeros(n)) for v in views}
        for j, c in enumerate(data.heldout):
            models = {"heldout": self.global_params}
            if self.method.personalized:
                state: dict[str, Any] = {LOCAL_PARAMS: dict(self._initial_local)} if self._initial_local else {}
                args = (self.method, self.model, self.settings, self.cfg.seed, c.cid, rnd)
                received, sent = self.global_params, self.server.broadcast()
                upload = train_client(*args, received, sent, state, c.x_train, c.y_train, input_noise=c.input_noise)
                own = self.method.client.personal_model(state)
                models["heldout_adapted"] = (
                    own if own is not None else personalized(*args, upload.params, state, c.x_train, c.y_train)
                )
            for view, params in models.items():
                self.model.load_state_dict(params)
                owner = torch.zeros(c.y_test.shape[0], dtype=torch.long, device=c.y_test.device)
                s = accumulate(batch_scores(self.model, c.x_test, c.y_test, self.eval_batch), owner, 1)
                for arr, v in zip(sums[view], (s.correct, s.loss_sum, s.count), strict=True):
                    arr[j] = v[0]
        out: dict[str, float] = {}
        for view, (correct, loss, count) in sums.items():
            out.update(summarize(view, ClientScores(correct, loss, count)))
        return out

    def evaluated_model(self, rnd: int | None) -> Params:
        """The model the global views score: the global one, or the method's post-hoc calibration of it (CCVR),
        which the clients never receive."""
        calibration = self.method.calibration
        if calibration is None:
            return self.global_params
        key = CalibrationKey(self.cfg.seed, rnd or self.cfg.rounds, self.settings.lr, self.settings.batch_size)
        return calibrated_model(calibration, self.model, self.data, self.global_params, key, self.eval_batch)

    def run(self, on_round: Callable[[RoundResult], None] | None = None) -> list[dict[str, Any]]:
        records = []
        for rnd in range(1, self.cfg.rounds + 1):
            result = self.round(rnd)
            records.append(result.record)
            if on_round is not None:
                on_round(result)
        return records
