"""The batched round's host work (benchmarks/host_ops.py): the same values in a few dispatches whatever the count of
clients. A round's operations outside the training steps are counted by the profiler, which is exact on every device
(no timing): the count an extra client adds is what a GPU's host pays per client in dispatches and launches."""

from pathlib import Path

import torch
from conftest import load_script
from torch.profiler import ProfilerActivity, profile

from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.engine.batched_steps import Flat
from fedskew.engine.loop import Simulation
from fedskew.protocol import Upload
from fedskew.server.uploads import UploadStack, copy_all

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "host_ops.py"


def _host_ops():
    return load_script(BENCH, "host_ops_under_test")


def test_flat_rows_are_each_rows_views():
    flat = Flat(["w", "b", "s"], [torch.Size([2, 3]), torch.Size([3]), torch.Size([])])
    stacked = torch.arange(4 * 10, dtype=torch.float32).view(4, 10)
    rows = flat.rows(stacked)
    assert len(rows) == 4
    for k, row in enumerate(rows):
        ref = flat.views(stacked[k])
        assert list(row) == list(ref)
        for n in ref:  # the same views: values, shape, strides and memory
            assert torch.equal(row[n], ref[n]) and row[n].stride() == ref[n].stride()
            assert row[n].data_ptr() == ref[n].data_ptr()
    rows[2]["b"][0] = -1.0  # views: a write reaches the stack
    assert stacked[2, 6] == -1.0
    assert Flat([], []).rows(torch.zeros(3, 0)) == [{}, {}, {}]


def test_flat_stack_flattens_a_repeated_row_once_into_new_memory():
    flat = Flat(["w", "b"], [torch.Size([2, 2]), torch.Size([2])])
    shared = [torch.randn(2, 2), torch.randn(2)]
    own = [torch.randn(2, 2), torch.randn(2)]
    rows = [shared, own, shared, shared]
    got = flat.stack(rows)
    ref = torch.stack([torch.cat([t.reshape(-1) for t in row]) for row in rows])
    assert torch.equal(got, ref)
    got[0, 0] = 99.0  # rows of their own: the inputs and the other rows untouched
    assert shared[0][0, 0] != 99.0 and got[2, 0] == ref[2, 0]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        flat.stack([shared] * 50)
    flattened = sum(e.name == "aten::reshape" for e in prof.events())
    assert flattened == 2  # fifty clients sent the same model (two tensors): one flattening


def test_copy_all_copies_one_by_one_across_dtypes():
    into = [torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.int64)]
    given = [torch.ones(3), torch.full((2,), 2.0, dtype=torch.float64), torch.tensor([3, 4])]
    copy_all(into, given)
    assert all(torch.equal(a, b) for a, b in zip(into, given, strict=True))
    same = [torch.zeros(2), torch.zeros(3)]
    copy_all(same, [torch.ones(2), torch.full((3,), 5.0)])  # one device and dtype: one multi-tensor copy
    assert same[0].tolist() == [1.0, 1.0] and same[1].tolist() == [5.0, 5.0, 5.0]
    copy_all([], [])


def test_an_upload_stack_fills_its_rows_and_extras_of_another_dtype():
    glob = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    stack = UploadStack(3, glob)
    ups = [
        Upload(cid=c, params={"w": torch.full((2, 2), float(c)), "b": torch.full((2,), -float(c))}, num_samples=1,
               extras={"mask": torch.tensor([c, c + 1]), "d": torch.full((1,), c / 2, dtype=torch.float64)})
        for c in range(3)
    ]  # fmt: skip
    for u in ups:
        assert stack.add(u) is None
    assert stack.next_row() is None
    for row, u in enumerate(ups):
        for n in glob:
            assert torch.equal(stack.params[n][row], u.params[n])
        for n in ("mask", "d"):
            assert torch.equal(stack.extras[n][row], u.extras[n])
    bad = Upload(cid=9, params=glob, num_samples=1, extras={"mask": torch.zeros(3, dtype=torch.int64)})
    fresh = UploadStack(2, glob)
    assert fresh.add(ups[0]) is None
    assert "extras" in fresh.add(bad).reason  # compared with the first accepted upload's rows


def _ops_outside_steps(per_round: int) -> float:
    cfg = make_config(
        None,
        {"dataset": "digits", "partition": "iid", "clients": 100, "join_ratio": per_round / 100, "model": "mlp",
         "batch_size": 10, "skew_probes": 0, "batched_clients": True, "capture_steps": True, "rounds": 4,
         "eval_every": 100},
    )  # fmt: skip
    sim = Simulation(cfg, build_federated(cfg))
    sim.round(1)
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        sim.round(2)
        sim.round(3)
    sim.close()
    by, in_steps = _host_ops().attribute(prof.events())
    assert in_steps > 0  # the steps' bodies are told apart
    return sum(by.values()) / 2


def test_a_client_adds_few_dispatches_to_a_batched_round():
    few, many = _ops_outside_steps(10), _ops_outside_steps(30)
    per_client = (many - few) / 20
    # measured: 6 on this MLP (its batch order: a permutation; its upload's copy); 11 with each upload's finiteness
    # checked apart (a multi-tensor norm and a device sync each; now one for the round's uploads together), 19 with
    # the trained rows' views made row by row again; 74 on the pfl-shaped CNN round before the uploads' checks and
    # copies became multi-tensor operations (every tensor of every client indexed, summed and copied apart:
    # benchmarks/host_ops.py)
    assert per_client <= 8, (few, many)


def test_row_views_cross_chunks_and_match_indexing():
    from fedskew.server.uploads import ROW_CHUNK, RowViews

    buf = torch.arange(3 * (2 * ROW_CHUNK + 5), dtype=torch.float32).view(-1, 3)
    rows = RowViews(buf)
    for i in [0, 1, ROW_CHUNK - 1, ROW_CHUNK, 2 * ROW_CHUNK + 4, 3, 2 * ROW_CHUNK]:  # forwards, back, forwards
        assert rows[i].data_ptr() == buf[i].data_ptr() and rows[i].shape == buf[i].shape
        assert torch.equal(rows[i], buf[i])
    assert len(rows.views) <= ROW_CHUNK  # one chunk's views held, whatever the capacity


def test_a_stack_past_a_chunk_of_rows_holds_every_upload():
    from fedskew.server.uploads import ROW_CHUNK

    glob = {"w": torch.zeros(2)}
    n = ROW_CHUNK + 7
    stack = UploadStack(n, glob)
    for c in range(n):
        row = stack.next_row()
        if c % 2:  # trained in place: the row itself is the upload
            row["w"].fill_(float(c))
            params = row
        else:
            params = {"w": torch.full((2,), float(c))}
        assert stack.add(Upload(cid=c, params=params, num_samples=1, extras={"e": torch.tensor([c])})) is None
    assert stack.params["w"][:, 0].tolist() == [float(c) for c in range(n)]
    assert stack.extras["e"][:, 0].tolist() == list(range(n))


def test_host_ops_refuses_a_count_of_rounds_below_one():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(BENCH), "--rounds", "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--rounds must be at least 1" in done.stderr
