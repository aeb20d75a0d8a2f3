"""The exact finiteness check by sums (server.api.nonfinite) and the upload-buffer pool (engine/buffers.py)."""

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
        torch.tensor([1.0, float("nan")], dtype=torch.float64),
        torch.tensor([float("-inf")], dtype=torch.bfloat16),
        torch.zeros(0),
    ]
    assert nonfinite(cases) == [1, 4, 5, 7, 8]
    assert nonfinite([]) == [] and nonfinite([torch.tensor([1, 2])]) == []


def test_pool_reuses_a_free_buffer_only():
    pool = BufferPool()
    a = pool.empty("w", (4, 3), torch.float32, "cpu")
    ptr = a.data_ptr()
    del a
    b = pool.empty("w", (4, 3), torch.float32, "cpu")
    assert b.data_ptr() == ptr  # nothing held a view: the same memory
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
