"""Issue 24 item 4: fedskew's server steps as Flower-native strategies (``fedskew.flower.strategies``).

A Flower quickstart-style ClientApp (plain PyTorch, sklearn digits, no fedskew inside it) runs against a ServerApp whose
strategy is FedDisco / FedHEAL / FedSA, in this process (fedskew's InProcessGrid: real Messages serialized and read
back, no network, no Ray). The weights, masks and aggregates the strategy used are checked against fedskew's own pieces
replayed on the same uploads.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.common.constant import SUPERLINK_NODE_ID  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from fedskew.catalog.disco import disco_weights, discrepancy  # noqa: E402
from fedskew.catalog.fedsa import FedSACombine  # noqa: E402
from fedskew.catalog.heal import FaelWeights, HealMasks  # noqa: E402
from fedskew.flower.inprocess import InProcessGrid, task_identity  # noqa: E402
from fedskew.flower.strategies import FedDisco, FedHEAL, FedPake, FedSA, FedskewStrategy  # noqa: E402
from fedskew.protocol import NonFiniteUploadError, ServerContext, Upload, UploadError  # noqa: E402
from fedskew.server.combine import WeightedMean  # noqa: E402
from fedskew.server.uploads import stack_uploads  # noqa: E402
from fedskew.server.weights import SampleWeights  # noqa: E402

CLIENTS, ROUNDS = 3, 2


# ---- the user's side: a quickstart-style ClientApp, plain PyTorch ------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 8), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def load_partition(pid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A label-skewed slice of sklearn's digits: client pid holds mostly 4 classes, sizes differ."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    keep = np.isin(y, [(pid * 3 + c) % 10 for c in range(4)]) | (np.arange(len(y)) % 17 == pid)
    idx = np.flatnonzero(keep)[: 120 + 40 * pid]
    return torch.tensor(x[idx] / 16.0, dtype=torch.float32), torch.tensor(y[idx])


def make_client_app(
    label_info: str, log: list[dict], bad_pid: int | None = None, mods: list | None = None
) -> ClientApp:
    app = ClientApp(mods=mods or [])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid, rnd = context.node_config["partition-id"], msg.content["config"]["server-round"]
        model = Net()
        received = msg.content["arrays"].to_torch_state_dict()
        model.load_state_dict(received)
        x, y = load_partition(pid)
        torch.manual_seed(100 * rnd + pid)
        opt = torch.optim.SGD(model.parameters(), lr=msg.content["config"]["lr"])
        for batch in torch.randperm(len(y)).split(32):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
        counts = np.bincount(y.numpy(), minlength=10)
        metrics: dict = {"train_loss": loss.item(), "num-examples": len(y)}
        if label_info == "label-counts":
            metrics["label-counts"] = counts.tolist()
        elif label_info == "discrepancy":  # the client's own KL(P_k || uniform)
            p = counts[counts > 0] / counts.sum()
            metrics["discrepancy"] = float((p * np.log(p * 10)).sum())
        state = {k: v.clone() for k, v in model.state_dict().items()}
        if pid == bad_pid:
            state["fc2.bias"][0] = float("nan")
        log.append(
            {
                "round": rnd,
                "node": context.node_id,
                "received": received,
                "sent": state,
                "n": len(y),
                "counts": counts,
                "metrics": dict(metrics),
            }
        )
        content = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(metrics)})
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = load_partition(context.node_config["partition-id"])
        acc = float((model(x).argmax(1) == y).float().mean())
        return Message(RecordDict({"metrics": MetricRecord({"eval_acc": acc, "num-examples": len(y)})}), reply_to=msg)

    return app


def make_grid(client_app: ClientApp) -> InProcessGrid:
    nodes = [{"partition-id": i, "num-partitions": CLIENTS} for i in range(CLIENTS)]
    return InProcessGrid(client_app, nodes, {"lr": 0.1})


def run_flower(strategy, client_app: ClientApp):
    """The quickstart ServerApp with ``strategy`` in place of FedAvg, run in process."""
    grid, out = make_grid(client_app), {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(0)
        out["result"] = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(Net().state_dict()),
            train_config=ConfigRecord({"lr": 0.1}),
            num_rounds=ROUNDS,
        )

    with task_identity(run_id=1, node_id=SUPERLINK_NODE_ID):
        server_app(grid, Context(1, SUPERLINK_NODE_ID, {}, RecordDict(), {}))
    return out["result"], grid


# ---- helpers: fedskew's pieces replayed on what the clients sent -------------------------------------------------
def round_input(log: list[dict], rnd: int, nodes: tuple[int, ...], cid: dict[int, int], hists: bool = False):
    recs = {r["node"]: r for r in log if r["round"] == rnd}
    assert sorted(recs) == sorted(nodes)
    ups = [Upload(cid[nd], recs[nd]["sent"], recs[nd]["n"]) for nd in nodes]
    glob = recs[nodes[0]]["received"]
    label_hists = np.stack([recs[nd]["counts"] for nd in nodes]) if hists else np.zeros((len(nodes), 0))
    rin = stack_uploads(ups, rnd=rnd, global_params=glob, trainable=frozenset(glob), label_hists=label_hists)
    return rin, recs


def model_after(log: list[dict], result, rnd: int) -> dict[str, torch.Tensor]:
    """The global model after round ``rnd``: what round rnd+1 broadcast, or the strategy's final arrays."""
    if rnd == ROUNDS:
        return result.arrays.to_torch_state_dict()
    return next(r["received"] for r in log if r["round"] == rnd + 1)


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.allclose(a[k].double(), b[k].double(), atol=atol, rtol=0), k


# ---- FedDisco ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("label_info", ["label-counts", "discrepancy"])
def test_feddisco_weights_are_fedskews_disco_weights_and_the_model_their_average(one_thread, label_info):
    log: list[dict] = []
    strategy = FedDisco(a=0.5, b=0.1, fraction_evaluate=1.0)
    result, _ = run_flower(strategy, make_client_app(label_info, log))
    assert len(strategy.history) == ROUNDS and result.evaluate_metrics_clientapp  # Flower's loop ran as usual
    for rec in strategy.history:
        recs = {r["node"]: r for r in log if r["round"] == rec.round}
        n = np.array([recs[nd]["n"] for nd in rec.nodes], dtype=np.float64)
        d = discrepancy(np.stack([recs[nd]["counts"] for nd in rec.nodes]), None, "kl")
        expected = disco_weights(n, d, metric="kl", a=0.5, b=0.1)
        assert np.allclose(rec.weights, expected, atol=1e-9, rtol=0)
        assert not np.allclose(expected, n / n.sum(), atol=1e-3)  # Disco really re-weights this federation
        want = {
            k: sum(w * recs[nd]["sent"][k].double() for w, nd in zip(expected, rec.nodes, strict=True))
            for k in recs[rec.nodes[0]]["sent"]
        }
        assert_close(model_after(log, result, rec.round), {k: v.float() for k, v in want.items()})
    assert strategy.last_weights == dict(zip(strategy.history[-1].nodes, strategy.history[-1].weights, strict=True))


def test_feddisco_refuses_a_reply_without_label_information_naming_the_node(one_thread):
    log: list[dict] = []
    with pytest.raises(ValueError, match=r"node (\d+) carries neither 'counts' .* nor 'd_k'") as err:
        run_flower(FedDisco(label_counts_key="counts", discrepancy_key="d_k"), make_client_app("none", log))
    node = int(err.value.args[0].split("node ")[1].split()[0])
    assert node in {r["node"] for r in log}
    for bad in ({"a": -1}, {"b": math.inf}, {"metric": "js"}, {"target": (1.0, 0.0)}, {"discrepancy_key": ""}):
        with pytest.raises(ValueError):
            FedDisco(**bad)


def test_non_finite_uploads_fail_naming_the_node_or_are_dropped(one_thread):
    log: list[dict] = []
    grid = make_grid(make_client_app("label-counts", log, bad_pid=1))
    bad_node = grid.node_of("partition-id", 1)
    with pytest.raises(NonFiniteUploadError, match=rf"node {bad_node} is refused: tensor 'fc2.bias' contains NaN"):
        run_flower(FedDisco(), make_client_app("label-counts", log, bad_pid=1))
    strategy = FedDisco(on_bad_update="drop")
    run_flower(strategy, make_client_app("label-counts", log, bad_pid=1))
    for rec in strategy.history:
        assert [n for n, _ in rec.dropped] == [bad_node] and bad_node not in rec.nodes and len(rec.nodes) == 2


# ---- FedHEAL -------------------------------------------------------------------------------------------------------
def test_fedheal_masks_and_weights_are_fedskews_heal_pieces_across_rounds(one_thread):
    log: list[dict] = []
    strategy = FedHEAL(tau=0.3, beta=0.4)
    result, _ = run_flower(strategy, make_client_app("none", log))
    cid = {nd: i for i, nd in enumerate(sorted({r["node"] for r in log}))}
    masking, weighting = HealMasks(tau=0.3), FaelWeights(beta=0.4)
    ctx = ServerContext(CLIENTS, 10, {}, frozenset(), np.ones(CLIENTS), np.ones((CLIENTS, 10)))
    mstate, wstate = masking.init(ctx), weighting.init(ctx)
    for rec in strategy.history:
        rin, recs = round_input(log, rec.round, rec.nodes, cid)
        masks, mstate = masking(rin, mstate)
        weights, wstate = weighting(rin, masks, wstate)
        assert np.allclose(rec.weights, weights.numpy(), atol=1e-9, rtol=0)
        expected, _, _ = WeightedMean()(rin, weights, masks, None)
        assert_close(model_after(log, result, rec.round), expected, atol=1e-7)
        w = weights.double()
        for k in expected:  # the masked weighted mean, written out: kept weight renormalized, else unchanged
            m, x = masks[k].double(), rin.params[k].double()
            wk = w.reshape(-1, *[1] * (x.dim() - 1))
            kept = (wk * m).sum(0)
            mean = torch.where(kept > 0, (wk * m * x).sum(0) / kept.clamp_min(1e-300), rin.global_params[k].double())
            assert torch.allclose(expected[k].double(), mean, atol=1e-6, rtol=0)
    assert strategy.last_masks is not None and set(strategy.last_masks) == set(masks)
    for k in masks:
        assert torch.equal(strategy.last_masks[k], masks[k])
    assert not all(bool(m.all()) for m in masks.values())  # round 2 does mask inconsistent elements
    with pytest.raises(ValueError, match="beta"):
        FedHEAL(beta=2.0)
    with pytest.raises(ValueError, match="datasize"):
        FedHEAL(fael_init="datasize")


# ---- FedSA ---------------------------------------------------------------------------------------------------------
def test_fedsa_aggregate_is_fedskews_fedsa_combine(one_thread):
    log: list[dict] = []
    strategy = FedPake(lam=0.2, C=3, S=2)
    assert FedPake is FedSA
    result, _ = run_flower(strategy, make_client_app("none", log))
    cid = {nd: i for i, nd in enumerate(sorted({r["node"] for r in log}))}
    for rec in strategy.history:
        rin, _ = round_input(log, rec.round, rec.nodes, cid)
        weights, _ = SampleWeights()(rin, None, None)
        expected, diag, _ = FedSACombine(lam=0.2, C=3, S=2)(rin, weights, None, None)
        assert diag["fedsa_high_frac"] > 0  # the high-dispersion branch ran
        assert_close(model_after(log, result, rec.round), expected, atol=0)
        assert rec.diagnostics["fedsa"] == diag["fedsa"]
        # history records the weights the combine uses: uniform by default (issue 45: it showed sample shares)
        assert np.allclose(rec.weights, 1 / len(rec.nodes), atol=1e-12)
    sampled = FedSA(lam=0.2, C=3, S=2, low_weighting="samples")
    run_flower(sampled, make_client_app("none", log := []))
    n = {r["node"]: r["n"] for r in log}
    w = np.array([n[nd] for nd in sampled.history[0].nodes], dtype=np.float64)
    assert np.allclose(sampled.history[0].weights, w / w.sum(), atol=1e-12)
    with pytest.raises(ValueError, match="C"):
        FedSA(C=0)


# ---- the generic adapter -------------------------------------------------------------------------------------------
def test_generic_adapter_with_fedavg_equals_flowers_fedavg(one_thread):
    log: list[dict] = []
    grid = make_grid(make_client_app("label-counts", log))
    torch.manual_seed(0)
    arrays = ArrayRecord(Net().state_dict())
    ours, disco = FedskewStrategy("fedavg"), FedDisco(a=0.3)
    named_disco = FedskewStrategy("disco", method_args={"a": 0.3})
    with task_identity(run_id=1, node_id=SUPERLINK_NODE_ID):
        for s in (disco, named_disco):
            s.configure_train(1, arrays, ConfigRecord({"lr": 0.1}), grid)
        replies = list(grid.send_and_receive(ours.configure_train(1, arrays, ConfigRecord({"lr": 0.1}), grid)))
    got, got_metrics = ours.aggregate_train(1, replies)
    want, want_metrics = FedAvg().aggregate_train(1, replies)
    assert_close(got.to_torch_state_dict(), want.to_torch_state_dict(), atol=1e-6)
    # Flower averages every key into its training metrics, the label counts too (a meaningless number); fedskew
    # keeps what a strategy reads of the clients out of them (issue 45)
    assert "label-counts" in want_metrics and "label-counts" not in got_metrics
    assert got_metrics.keys() == want_metrics.keys() - {"label-counts"}
    assert got_metrics["train_loss"] == want_metrics["train_loss"]
    n = np.array([next(r["n"] for r in log if r["node"] == nd) for nd in ours.history[0].nodes], dtype=np.float64)
    assert np.allclose(ours.history[0].weights, n / n.sum(), atol=1e-12, rtol=0)
    # a composition by name runs the same pieces as the dedicated class
    (a, _), (b, _) = disco.aggregate_train(1, replies), named_disco.aggregate_train(1, replies)
    assert_close(a.to_torch_state_dict(), b.to_torch_state_dict(), atol=0)
    assert disco.history[0].weights == named_disco.history[0].weights
    cases = (
        ("fedcac", "personalized"),
        ("fedavg+nope", "unknown"),
        ("fedavg", "on_bad_update"),
        ("scaffold", "server half .ScaffoldServer"),  # its global control variate would be silently dropped
        ("fedproto+heal", "server half .PrototypeServer"),
    )
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            FedskewStrategy(bad, on_bad_update="x" if match == "on_bad_update" else "fail")


def test_a_non_integer_weight_is_taken_as_flowers_fedavg_takes_it(one_thread):
    """Issue 45: a non-integer ``num-examples`` was refused where Flower's FedAvg weighs by it."""
    log: list[dict] = []
    grid = make_grid(make_client_app(None, log))
    torch.manual_seed(0)
    arrays = ArrayRecord(Net().state_dict())
    ours = FedskewStrategy("fedavg")
    with task_identity(run_id=1, node_id=SUPERLINK_NODE_ID):
        replies = list(grid.send_and_receive(ours.configure_train(1, arrays, ConfigRecord({"lr": 0.1}), grid)))
    for i, reply in enumerate(replies):
        reply.content["metrics"]["num-examples"] = 10.5 + i
    got, _ = ours.aggregate_train(1, replies)
    want, _ = FedAvg().aggregate_train(1, replies)
    assert_close(got.to_torch_state_dict(), want.to_torch_state_dict(), atol=1e-6)
    w = np.array([10.5 + i for i in range(len(replies))])
    assert np.allclose(sorted(ours.history[0].weights), sorted(w / w.sum()), atol=1e-12)
    for bad in (0, -1.0, float("nan"), float("inf")):
        replies[0].content["metrics"]["num-examples"] = bad
        with pytest.raises(UploadError, match="expected a positive finite number"):
            ours.aggregate_train(1, replies)


# ---- user-level DP on the Flower-native strategies ---------------------------------------------------------------
def test_dp_clips_on_the_node_and_noises_once_on_the_server(one_thread):
    """FedskewStrategy(dp=FlowerDP(...)) with the nodes' dp_clip_mod: the new model is the received one plus the mean
    of the clipped updates (uniform weights, full participation: D = 3) plus noise of std z*C/D; ε per round is the
    accountant's for (z, full participation, round)."""
    from fedskew.flower.native_dp import FlowerDP, dp_clip_mod
    from fedskew.privacy.accountant import Sampling, epsilon
    from fedskew.privacy.mechanism import clip_update

    clip, z = 0.2, 1e-3
    log: list[dict] = []
    app = make_client_app("none", log, mods=[dp_clip_mod(clip)])
    strategy = FedskewStrategy(
        "fedavg", method_args={"weights": "uniform"}, dp=FlowerDP(clip=clip, rounds=ROUNDS, noise_multiplier=z)
    )
    result, _ = run_flower(strategy, app)
    for rnd in range(1, ROUNDS + 1):
        recs = [r for r in log if r["round"] == rnd]
        received = recs[0]["received"]
        names = [n for n, t in received.items() if t.is_floating_point()]
        clipped = [clip_update(received, r["sent"], names, clip)[0] for r in recs]
        norms = [math.sqrt(sum(float(((r["sent"][n] - received[n]) ** 2).sum()) for n in names)) for r in recs]
        assert max(norms) > clip  # the clip bites: the updates were longer than C
        want = {n: received[n] + sum(c[n] - received[n] for c in clipped) / len(recs) for n in received}
        assert_close(model_after(log, result, rnd), want, atol=10 * z * clip)
        eps = strategy.history[rnd - 1].diagnostics["epsilon"]
        assert eps == pytest.approx(epsilon(z, Sampling("full", CLIENTS), rnd, 1e-5, "rdp"), rel=1e-9)
    assert strategy.privacy is not None and strategy.privacy.denominator == pytest.approx(CLIENTS)


def test_dp_refuses_what_cannot_be_private_on_flower(one_thread):
    from fedskew.flower.native_dp import FlowerDP, dp_clip_mod

    dp = FlowerDP(clip=1.0, rounds=2, noise_multiplier=1.0)
    for name in ("heal", "fedsa"):
        with pytest.raises(ValueError, match="cannot run under differential privacy"):
            FedskewStrategy(name, dp=dp)
    with pytest.raises(ValueError, match="give exactly one of noise_multiplier and target_epsilon"):
        FlowerDP(clip=1.0, rounds=2)
    with pytest.raises(ValueError, match="clip must be positive"):
        dp_clip_mod(0.0)
    log: list[dict] = []
    with pytest.raises(ValueError, match="use method_args=\\{'weights': 'uniform'\\}"):
        run_flower(FedskewStrategy("fedavg", dp=dp), make_client_app("none", log, mods=[dp_clip_mod(1.0)]))
