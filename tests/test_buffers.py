"""The exact finiteness check by sums (server.api.nonfinite) and the upload-buffer pool (engine/buffers.py)."""

import numpy as np
import torch

from fedskew.engine.buffers import BufferPool
from fedskew.server.uploads import nonfinite


def test_nonfinite_is_exact():
    ok = torch.randn(1000)
    overflow = torch.tensor([3e38, 3e38])  # finite elements whose float32 sum overflows: not flagged
    cases = [
        ok,
        torch.tensor([1.0, float("nan")]),
        overflow,
        torch.tensor([1, 2]),  # integers are never non-finite
        torch.tensor([float("inf")]),
        torch.tensor([float("-inf"), float("inf")]),
        torch.tensor([60000.0, 60000.0], dtype=torch.float16),
        torch.tensor([60000.0, -60000.0], dtype=torch.float16),  # a zero sum, an abs-sum past float16's range
        torch.tensor([1.0, float("nan")], dtype=torch.float64),
        torch.tensor([float("-inf")], dtype=torch.bfloat16),
        torch.zeros(0),
    ]
    assert nonfinite(cases) == [1, 4, 5, 8, 9]
    assert nonfinite([]) == [] and nonfinite([torch.tensor([1, 2])]) == []


def test_pool_reuses_a_free_buffer_only():
    pool = BufferPool()
    a = pool.empty("w", (4, 3), torch.float32, "cpu")
    ptr = a.data_ptr()
    del a
    b = pool.empty("w", (4, 3), torch.float32, "cpu")
    assert b.data_ptr() == ptr  # nothing held a view: the same memory
    b.fill_(1.0)  # (uninitialized memory may hold NaN, which no torch.equal matches)
    keep = b[1]  # a view that outlives the round (e.g. a personalized model)
    del b
    c = pool.empty("w", (4, 3), torch.float32, "cpu")
    assert c.data_ptr() != ptr  # still referenced: a new buffer, the view untouched
    keep_value = keep.clone()
    c.fill_(7.0)
    assert torch.equal(keep, keep_value)
    del c
    assert pool.empty("w", (2, 3), torch.float32, "cpu").shape == (2, 3)  # fewer rows: a view of the pooled one
    assert pool.empty("w", (9, 3), torch.float32, "cpu").shape == (9, 3)  # more rows: a larger one
    assert pool.empty("w", (9, 5), torch.float32, "cpu").shape == (9, 5)  # another row shape: its own slot
    assert pool.empty("w", (9, 3), torch.float64, "cpu").dtype == torch.float64


def test_a_model_bound_to_a_stack_row_trains_there_and_the_stack_skips_the_copy():
    from fedskew.engine.buffers import TrainInPlace
    from fedskew.protocol import Upload
    from fedskew.server.uploads import UploadStack

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    template = {n: t.detach().clone() for n, t in model.state_dict().items()}
    stack = UploadStack(2, template)
    own = {n: t.data_ptr() for n, t in model.state_dict().items()}
    place = TrainInPlace(model)
    assert place.bind(stack.next_row())
    model.load_state_dict(template)  # loading the received model writes the row (it starts uninitialized)
    with torch.no_grad():
        model[0].weight.fill_(3.0)  # training writes the row
    upload = Upload(0, dict(model.state_dict()), 5)
    place.restore()
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == own  # the model's own tensors back
    assert stack.add(upload) is None
    upload.params["0.weight"].fill_(4.0)  # the row itself: what the stack holds
    assert torch.equal(stack.params["0.weight"][0], torch.full((2, 3), 4.0))
    other = Upload(1, {n: t.clone() for n, t in template.items()}, 5)
    assert stack.add(other) is None and torch.equal(stack.params["0.weight"][1], template["0.weight"])  # copied
    assert stack.next_row() is None  # full: nothing to bind to
    assert not place.bind(None)


def test_a_row_that_does_not_match_or_a_tied_model_is_not_bound():
    from fedskew.engine.buffers import TrainInPlace

    model = torch.nn.Linear(3, 2)
    place = TrainInPlace(model)
    assert not place.bind({"weight": torch.zeros(2, 3)})  # a name missing
    assert not place.bind({"weight": torch.zeros(3, 2), "bias": torch.zeros(2)})  # a shape differs
    assert not place.bind({"weight": torch.zeros(2, 3, dtype=torch.float64), "bias": torch.zeros(2)})
    tied = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False))
    tied[1].weight = tied[0].weight
    row = {n: torch.zeros_like(t) for n, t in tied.state_dict().items()}
    assert not TrainInPlace(tied).bind(row)  # binding them apart would untie them
    assert tied[0].weight is tied[1].weight


def test_training_in_the_stack_gives_the_records_of_training_apart(tmp_path, monkeypatch):
    """Per-FedAvg adapts the trained model right after its upload is taken: bound past the training, that would
    have written into the stacked upload (it did, before the binding ended with the training)."""
    import json

    from fedskew.config import make_config
    from fedskew.engine.buffers import TrainInPlace
    from fedskew.protocol import TIMING_KEYS
    from fedskew.runner import run_experiment

    def records(tag, method):
        out = tmp_path / f"{method}-{tag}"
        cfg = {"method": method, "clients": 5, "rounds": 2, "join_ratio": 0.8, "db": None, "seed": 7, "out": str(out)}
        run_experiment(make_config(None, cfg))
        rows = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS and k != "time"} for r in rows]

    bound = []
    bind = TrainInPlace.bind
    monkeypatch.setattr(TrainInPlace, "bind", lambda self, row: bound.append(bind(self, row)) or bound[-1])
    methods = ("perfedavg", "ditto+fedcac", "fedavg")
    together = {m: records("in-stack", m) for m in methods}
    assert bound and all(bound)
    monkeypatch.setattr(TrainInPlace, "bind", lambda self, row: False)
    assert {m: records("apart", m) for m in methods} == together


def test_nonfinite_each_checks_a_rounds_uploads_in_one_multi_tensor_norm():
    from torch.profiler import ProfilerActivity, profile

    from fedskew.protocol import Upload
    from fedskew.server.uploads import check_upload, nonfinite_each, upload_tensors

    glob = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}

    def up(cid, w=0.0, b=0.0, e=0.0, **params):
        p = {"w": torch.full((2, 2), w), "b": torch.tensor([1.0, b]), **params}
        return Upload(cid=cid, params=p, num_samples=1, extras={"e": torch.tensor([e], dtype=torch.float64)})

    nan, inf = float("nan"), float("inf")
    ups = [up(0), up(1, b=nan), up(2, e=-inf), up(3, w=inf, b=nan), up(4, w=3e38)]  # the last: finite, sums overflow
    ups.append(
        Upload(cid=5, params={"w": np.zeros((2, 2), dtype=np.float32), "b": torch.tensor([nan, 0.0])}, num_samples=1)
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        found = nonfinite_each(ups)
    assert found == [[], [1], [2], [0, 1], [], [1]]  # positions in upload_tensors: params, then extras
    assert sum(e.name == "aten::_foreach_norm" for e in prof.events()) == 1  # all 6 uploads' tensors at once
    assert [n for _, n, _ in upload_tensors(ups[2])] == ["w", "b", "e"]
    for u, bad in zip(ups, found, strict=True):  # the same verdict as an upload checked alone
        alone, together = check_upload(u, glob), check_upload(u, glob, None, bad)
        assert (alone is None) == (together is None)
        if alone is not None:
            assert alone.reason == together.reason and alone.nonfinite == together.nonfinite
    assert "'b' contains NaN or Inf" in check_upload(ups[1], glob, None, found[1]).reason
    assert "dtype" in check_upload(ups[5], glob, None, found[5]).reason  # not a tensor: its dtype is named first
    assert nonfinite_each([]) == []
