"""The server side of a round: one component that both hosts hold, the simulator (``engine/loop.py``) and the Flower
ServerApp (``flower/server_app.py``).

One round, as the server sees it::

    plan   = server.open_round(rnd)             # seeded sample and drop-outs, the broadcast, the [K, ...] buffers
    server.take_upload(plan, upload)            # validated into the buffers in client order (or rejected)
    result = server.close_round(plan, views)    # half.advance -> strategy.aggregate -> model checks -> views -> record

Between open and close the host gets the uploads: the simulator trains the clients itself, the Flower server sends
them messages. The host also keeps what the clients keep (their local entries, the model they trained) and scores the
views (``views``: its ``evaluate``). The server knows the clients only through :class:`~fedskew.protocol.ServerContext`
(sample counts and the reports the method declared), their uploads and, in a deployment, the ones that never replied;
it reads the run only through :class:`~fedskew.engine.settings.RoundSettings`.

What it carries from round to round (a checkpoint's server half): the global model, the strategy's state, the client
part's server half's state (SCAFFOLD's c) and the models it sent to clients (``personal``: personalized strategies;
a map of the host's client-state store, so a disk store keeps them out of RAM).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedskew.engine.buffers import BufferPool
from fedskew.engine.probe import skew_probe
from fedskew.engine.rounds import (
    Diverged,
    RoundPlan,
    RoundResult,
    cohort_size,
    dropped_out,
    payload_bytes,
    sample_clients,
)
from fedskew.engine.settings import RoundSettings
from fedskew.engine.state_store import keep_model, memory_budget
from fedskew.privacy.accountant import Sampling
from fedskew.privacy.server import PrivacyPlan, plan_privacy, private_server
from fedskew.protocol import (
    LABEL_HIST,
    TRAIN_LOSS,
    ClientScores,
    NonFiniteUploadError,
    Params,
    Rejection,
    ServerContext,
    Upload,
    client_reports,
)
from fedskew.seeding import Purpose, numpy_rng
from fedskew.server.api import RoundInput
from fedskew.server.paging import DiskBuffers, release_pages
from fedskew.server.streaming import RunningSum, stream_refusal
from fedskew.server.uploads import UploadStack, check_model, enforce, stack_metrics

if TYPE_CHECKING:
    from fedskew.data.pools import FederatedData
    from fedskew.methods import Method

# a host's views of the models after aggregation in round rnd: (the record's fields, per-view per-client scores)
Views = Callable[[int], tuple[dict[str, Any], dict[str, ClientScores]]]
# what the server knows of the clients when its host does not compute it from a partition (a deployment: the clients
# reported it): training sample counts [N], and the declared client reports, name -> [N, d]
Known = tuple[np.ndarray, Mapping[str, np.ndarray]]


def server_context(
    data: FederatedData,
    method: Method,
    template: Params,
    trainable: frozenset[str],
    seed: int,
    known: Known | None = None,
) -> ServerContext:
    """What the server knows before round 1: from ``data``'s partition (the simulator), or ``known`` (a deployment's
    clients reported it; ``data`` is then the server's view, with no client data)."""
    num_train, reports = known or (data.num_train, client_reports(method.reports, data.train_hists))
    declared = dict(reports)  # only the declared ones (protocol.ClientReport)
    return ServerContext(
        num_clients=data.num_clients,
        num_classes=data.num_classes,
        template=template,
        trainable=trainable,
        num_train=np.asarray(num_train),
        label_hists=declared.get(LABEL_HIST.name),
        seed=seed,
        reports=declared,
    )


STREAM_ABOVE = 512 * 2**20  # aggregation auto: stream when the round's stacked uploads would exceed this (bytes)


def streams(settings: RoundSettings, method: Method, ctx: ServerContext) -> bool:
    """Whether the round server sums the uploads as they arrive (:mod:`fedskew.server.streaming`): ``streaming``
    (the configuration has checked that the composition allows it), or ``auto`` when it allows it, no skew probe
    or DP reads the stack, and the expected cohort's stacked uploads would take over :data:`STREAM_ABOVE`."""
    if settings.aggregation != "auto":
        return settings.aggregation == "streaming"
    if settings.skew_probes or settings.dp_clip is not None or stream_refusal(method) is not None:
        return False
    return expected_stack_bytes(settings, ctx) > STREAM_ABOVE


def expected_stack_bytes(settings: RoundSettings, ctx: ServerContext) -> float:
    """The bytes of an expected cohort's uploads stacked (``aggregation auto`` decides by them)."""
    return cohort_sampling(settings, ctx.num_clients).expected_cohort * payload_bytes(ctx.template)


def stacks_on_disk(settings: RoundSettings, ctx: ServerContext) -> bool:
    """Whether a stacked round keeps its uploads in files (:mod:`fedskew.server.paging`): ``disk``, or ``auto`` when
    the expected cohort's stacked uploads (with the extras, about as large as the model at most) would exceed the
    RAM budget of ``state_memory`` and the run is on the CPU."""
    if settings.aggregation != "auto":
        return settings.aggregation == "disk"
    if any(t.device.type != "cpu" for t in ctx.template.values()):
        return False
    return expected_stack_bytes(settings, ctx) > memory_budget(settings.state_memory)


def cohort_sampling(settings: RoundSettings, num_clients: int) -> Sampling:
    """How the run's cohorts are drawn, as the DP accountant counts them (full participation: no amplification)."""
    if settings.client_sampling == "poisson":
        return Sampling("poisson", num_clients, q=settings.join_ratio)
    m = cohort_size(num_clients, settings.join_ratio)
    return Sampling("full", num_clients) if m >= num_clients else Sampling("fixed", num_clients, m=m)


class RoundServer:
    """The server of one federation: the method's server strategy and client part's server half, their states, the
    global model and the personalized models it sent, driven one round at a time (see the module docstring)."""

    def __init__(
        self,
        settings: RoundSettings,
        method: Method,
        ctx: ServerContext,
        *,
        local_names: frozenset[str],
        personal: MutableMapping[int, Params],
        scratch: Path | None = None,
    ) -> None:
        """``local_names``: the state-dict entries the clients keep for themselves (never on the wire);
        ``personal``: where the models sent to individual clients live (a client-state store's map); ``scratch``:
        where a disk-backed upload stack puts its (unnamed) files (default: the temporary directory)."""
        self.settings = settings
        self.method = method
        self.ctx = ctx
        self.local_names = local_names
        self.personal = personal
        self.global_params: Params = ctx.template
        self.reports: dict[str, np.ndarray] = dict(ctx.reports)
        # the training loss of a uniform prediction is ln(classes); a round above divergence_factor times that diverged
        factor = settings.divergence_factor
        self.loss_limit = factor * math.log(ctx.num_classes) if factor else math.inf
        # user-level DP (dp_clip set): the composition's weighted mean replaced by its private form, or refused
        self.privacy: PrivacyPlan | None = None
        self.strategy: Any = method.server
        if settings.dp_clip is not None:
            self.privacy = plan_privacy(
                method,
                ctx,
                clip=settings.dp_clip,
                noise_multiplier=settings.dp_noise,
                target_epsilon=settings.dp_epsilon,
                delta=settings.dp_delta,
                accountant=settings.dp_accountant,  # type: ignore[arg-type]
                sampling=cohort_sampling(settings, ctx.num_clients),
                rounds=settings.rounds,
                weight_cap=settings.dp_weight_cap,
                clip_quantile=settings.dp_clip_quantile,
                clip_lr=settings.dp_clip_lr,
                count_noise=settings.dp_count_noise,
                report_noise=settings.dp_report_noise,
            )
            self.strategy = private_server(method, self.privacy, ctx, local_names)
        self.server_state = self.strategy.init(ctx)
        method.client.check_model(ctx.template, ctx.trainable)
        self.streaming = streams(settings, method, ctx)
        # what the server keeps for the client part (SCAFFOLD's c), advanced before each aggregation
        self.server_half_state = method.server_half.init(ctx)
        # the upload stacks' [K, ...] buffers: in RAM, reused across rounds when free, or in files (server/paging.py)
        self.on_disk = not self.streaming and stacks_on_disk(settings, ctx)
        self._buffers = DiskBuffers(scratch) if self.on_disk else BufferPool()

    @property
    def trainable(self) -> frozenset[str]:
        return self.ctx.trainable

    def received(self, cid: int) -> Params:
        """The model the server sends client ``cid``: its personalized model, else the global one; a personalized
        step that sends a client some entries only (FedPAC's head) has the global model's other entries filled in."""
        own = self.personal.get(cid)
        if own is None:
            return self.global_params
        if len(own) == len(self.global_params):
            return own
        return {k: own.get(k, g) for k, g in self.global_params.items()}

    def broadcast(self) -> Params:
        """What the server half sends every sampled client beside its model (SCAFFOLD's c; ``{}`` for most)."""
        sent = self.method.server_half.broadcast(self.server_half_state)
        if self.privacy is not None:  # the DP server's own (adaptive clipping: this round's clip)
            sent = {**sent, **self.strategy.broadcast(self.server_state)}
        return sent

    def sent_to(self, plan: RoundPlan, cid: int) -> Params:
        """What client ``cid`` receives beside its model this round: the broadcast, and what the server half sends it
        alone (its downloads, counted in the round's bytes down here, when they are sent)."""
        own = self.method.server_half.downloads(self.server_half_state, cid, plan.rnd, self.personal.get)
        if not own:
            return plan.broadcast
        plan.bytes_down += payload_bytes(own)
        return {**plan.broadcast, **own}

    def wire_bytes(self, params: Params) -> int:
        """Bytes of a model exchange; entries the clients keep locally (``method.local``) never travel."""
        return payload_bytes({k: v for k, v in params.items() if k not in self.local_names})

    def eval_sample(self, rnd: int) -> list[int] | None:
        """The clients whose per-client models round ``rnd`` scores: ``None`` (all) unless ``eval_clients`` is set
        and this is not the last round; else a sorted sample of that many, drawn from the run seed and the round
        (its own stream: no other draw moves)."""
        n, k = self.ctx.num_clients, self.settings.eval_clients
        if k is None or k >= n or rnd >= self.settings.rounds:
            return None
        rng = numpy_rng(self.settings.seed, Purpose.EVAL_SAMPLE, rnd)
        return sorted(int(c) for c in rng.choice(n, k, replace=False))

    # ---- one round ---------------------------------------------------------------------------------------
    def open_round(self, rnd: int) -> RoundPlan:
        """Start round ``rnd``: sample (seeded by (seed, round)), draw the drop-outs, prepare the upload buffers;
        every sampled client is sent its model and the broadcast, whether or not it reports."""
        s, n = self.settings, self.ctx.num_clients
        t0 = time.perf_counter()
        sampled = sample_clients(s.seed, rnd, n, s.join_ratio, s.client_sampling)
        gone = set(dropped_out(s.seed, rnd, sampled, n, s.client_dropout))
        broadcast = self.broadcast()
        stack: UploadStack | RunningSum = (
            RunningSum(self.global_params, self.method.server.weighting.arrival_weight)  # type: ignore[attr-defined]
            if self.streaming
            else UploadStack(len(sampled) - len(gone), self.global_params, self._buffers.empty)
        )
        plan = RoundPlan(rnd, sampled, gone, broadcast, stack, t0)
        plan.bytes_down = sum(self.wire_bytes(self.received(cid)) + payload_bytes(broadcast) for cid in sampled)
        return plan

    def take_upload(
        self, plan: RoundPlan, upload: Upload, nonfinite_at: Sequence[int] | None = None
    ) -> Rejection | None:
        """Validate one client's upload into the round's buffers; its rejection under ``on_bad_update``, if any
        (``nonfinite_at``: its finiteness, found with the round's other uploads: ``server.uploads.check_upload``)."""
        plan.bytes_up += self.wire_bytes(upload.params) + payload_bytes(upload.extras)
        rejected = plan.stack.add(upload, nonfinite_at)
        if rejected is None or self.settings.on_bad_update == "fail":
            plan.losses.append((upload.cid, upload.num_samples, upload.metrics.get(TRAIN_LOSS, math.nan)))
        return rejected

    def close_round(self, plan: RoundPlan, views: Views, commit: Callable[[], None] | None = None) -> RoundResult:
        """Aggregate the round's uploads with the method's server strategy, then (``commit``: the host's store writes
        the round's client state) score the host's ``views`` on the cadence and the skew probe, and record."""
        s, method = self.settings, self.method
        rnd, sampled, gone, stack = plan.rnd, plan.sampled, plan.gone, plan.stack
        t0, t1 = plan.t0, time.perf_counter()
        train_loss = self._check_training(rnd, plan.losses)
        try:
            enforce(stack.rejected, s.on_bad_update)
        except NonFiniteUploadError as error:  # fedskew trained these clients itself: that is divergence
            raise Diverged(rnd, str(error)) from None

        record: dict[str, Any] = {"round": rnd, "participants": stack.count, "train_loss": train_loss}
        if s.client_dropout > 0 or s.on_bad_update == "drop" or plan.failed:
            record["sampled"] = len(sampled)
        if s.client_dropout > 0:
            record["dropped_out"] = sorted(gone)
        if s.on_bad_update == "drop":
            record["dropped"] = [r.as_record() for r in stack.rejected]
        if plan.failed:
            record["failed"] = plan.failed
        rin, out = None, None
        streamed = isinstance(stack, RunningSum)
        if streamed:  # the round's record says its uploads were summed as they arrived (or securely)
            record["aggregation"] = stack.kind  # type: ignore[union-attr]
        if stack.count and streamed:
            out = self._aggregate_sums(rnd, stack)  # type: ignore[arg-type]
        elif stack.count:
            rows = {k: v[list(stack.cids)] for k, v in self.reports.items()}
            rin = stack.round_input(rnd=rnd, trainable=self.trainable, reports=rows)
            if self.privacy is None:
                self.server_half_state = method.server_half.advance(rin, self.server_half_state)
            elif method.server_half.private:  # DP: the half sees the extras only as their noised sum
                sums = self.strategy.extras_sums(rnd, rin.extras, self.server_state.clip, s.dp_extras_scale)
                self.server_half_state = method.server_half.advance_sums(sums, self.server_half_state)
            out, self.server_state = self.strategy.aggregate(rin, self.server_state)
            self._check_models(rnd, out.global_params, out.personal)
            self.global_params = out.global_params
            for cid, model in (out.personal or {}).items():
                keep_model(self.personal, cid, model)
                release_pages()  # a model beside a disk stack: its pages back to the kernel once written
        elif self.privacy is not None:  # an empty cohort under DP still releases the noise (a skip would tell)
            if method.server_half.private:
                sums = self.strategy.extras_sums(rnd, None, self.server_state.clip, s.dp_extras_scale)
                self.server_half_state = method.server_half.advance_sums(sums, self.server_half_state)
            self.global_params, self.server_state = self.strategy.no_uploads(rnd, self.global_params, self.server_state)
            record["dp_noise_only"] = True
        elif not sampled:  # an empty Poisson cohort
            record["skipped_aggregation"] = "no client was sampled"
        elif len(gone) == len(sampled):  # nobody to aggregate: every model and all server state stay as they are
            record["skipped_aggregation"] = "every sampled client dropped out"
        else:
            record["skipped_aggregation"] = "no sampled client replied" if plan.failed else "no valid upload"
        if commit is not None:
            commit()
        t2 = time.perf_counter()

        scores: dict[str, ClientScores] = {}
        evaluated = rnd % s.eval_every == 0 or rnd == s.rounds
        probe = None
        if evaluated:
            record_eval, scores = views(rnd)
            record.update(record_eval)
        t3 = time.perf_counter()
        if evaluated and s.skew_probes and rin is not None:
            probe = skew_probe(rin, self.global_params, s.skew_probes, s.seed)
        t4 = time.perf_counter()
        record.update(
            {
                "bytes_up": plan.bytes_up,
                "bytes_down": plan.bytes_down,
                "time_train": t1 - t0,
                "time_aggregate": t2 - t1,
                "time_eval": t3 - t2,
                "time_probe": t4 - t3,
                "time_round": t4 - t0,
                "evaluated": evaluated,
            }
        )
        if out is not None and out.diagnostics:
            record["diagnostics"] = out.diagnostics
        if self.privacy is not None:
            record["dp_epsilon"] = self.privacy.epsilon(rnd)
        return RoundResult(record, scores, probe)

    def _aggregate_sums(self, rnd: int, stack: RunningSum) -> Any:
        """Streaming aggregation's close: the private server half from the summed extras, the composition's step on
        the weighted mean (:meth:`fedskew.server.api.Aggregation.aggregate_sums`)."""
        rin = RoundInput(
            round=rnd,
            cids=tuple(stack.cids),
            params={},
            num_samples=torch.tensor(stack.num_samples, dtype=torch.float64),
            extras={},
            global_params=self.global_params,
            trainable=self.trainable,
            metrics=stack_metrics(stack.metrics),
            reports={k: v[list(stack.cids)] for k, v in self.reports.items()},
        )
        if self.method.server_half.private:
            self.server_half_state = self.method.server_half.advance_sums(stack.summed_extras(), self.server_half_state)
        out, self.server_state = self.strategy.aggregate_sums(rin, stack.mean(), stack.weights(), self.server_state)
        self._check_models(rnd, out.global_params, out.personal)
        self.global_params = out.global_params
        return out

    def budget_spent(self, rnd: int) -> bool:
        """Whether round ``rnd`` would spend more than the run's ε budget (DP with a budget; the run stops before)."""
        plan = self.privacy
        return plan is not None and plan.budget is not None and plan.epsilon(rnd) > plan.budget * (1 + 1e-9)

    # ---- checks ------------------------------------------------------------------------------------------
    def _check_training(self, rnd: int, losses: list[tuple[int, int, float]]) -> float | None:
        """The round's sample-weighted training loss over ``(cid, samples, loss)`` (``None`` when empty);
        :class:`Diverged` when a client's loss is not finite or the round's exceeds ``divergence_factor ×
        ln(classes)``."""
        if not losses:
            return None
        for cid, _, loss in losses:
            if not math.isfinite(loss):
                raise Diverged(rnd, f"client {cid}'s training loss is {loss}")
        n = np.array([s for _, s, _ in losses], dtype=np.float64)
        mean = float((n * np.array([loss for _, _, loss in losses])).sum() / n.sum())
        if mean > self.loss_limit:
            raise Diverged(
                rnd,
                f"training loss {mean:.3g} exceeds divergence_factor × ln({self.ctx.num_classes}) = "
                f"{self.loss_limit:.3g}",
            )
        return mean

    def _check_models(self, rnd: int, global_params: Params, personal: Mapping[int, Params] | None) -> None:
        """The server's models must match the template (names, shapes, dtypes) and be finite."""
        models = {"the aggregated global model": (global_params, False)}
        models.update({f"client {cid}'s personalized model": (p, True) for cid, p in (personal or {}).items()})
        for what, (params, partial) in models.items():
            bad = check_model(params, self.ctx.template, f"round {rnd}, {what}", partial=partial)
            release_pages()  # a model beside a disk stack: its pages back to the kernel once read
            if bad:
                raise Diverged(rnd, f"{what} holds NaN or Inf in {', '.join(bad[:3])}")
