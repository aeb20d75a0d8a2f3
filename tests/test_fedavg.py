"""FedAvg's server step equals a hand-computed weighted mean; uploads are validated."""

import numpy as np
import pytest
import torch

from fedskew.protocol import Upload, UploadError
from fedskew.server.api import Aggregation
from fedskew.server.combine import WeightedMean, weighted_mean
from fedskew.server.uploads import stack_uploads
from fedskew.server.weights import SampleWeights, UniformWeights


def _rin(updates, global_params):
    return stack_uploads(
        updates,
        rnd=1,
        global_params=global_params,
        trainable=frozenset({"w", "b"}),
        label_hists=np.zeros((len(updates), 2)),
    )


def _updates():
    return [
        Upload(0, {"w": torch.tensor([[1.0, 2.0]]), "b": torch.tensor([0.0]), "n": torch.tensor(3)}, 10),
        Upload(1, {"w": torch.tensor([[3.0, -2.0]]), "b": torch.tensor([1.0]), "n": torch.tensor(5)}, 30),
    ]


GLOBAL = {"w": torch.zeros(1, 2), "b": torch.zeros(1), "n": torch.tensor(0)}


def test_fedavg_equals_hand_weighted_mean():
    agg = Aggregation(SampleWeights(), WeightedMean())
    out, _ = agg.aggregate(_rin(_updates(), GLOBAL), agg.init(None))
    # weights 10/40 and 30/40
    assert torch.allclose(out.global_params["w"], torch.tensor([[0.25 * 1 + 0.75 * 3, 0.25 * 2 - 0.75 * 2]]))
    assert torch.allclose(out.global_params["b"], torch.tensor([0.75]))
    assert out.global_params["n"].item() == 5  # integer buffers take the max
    assert out.diagnostics["weights"] == pytest.approx([0.25, 0.75])


def test_uniform_fedavg():
    agg = Aggregation(UniformWeights(), WeightedMean())
    out, _ = agg.aggregate(_rin(_updates(), GLOBAL), agg.init(None))
    assert torch.allclose(out.global_params["w"], torch.tensor([[2.0, 0.0]]))


def test_masked_mean_renormalizes_and_keeps_untouched_elements():
    x = torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[True, False, False], [True, True, False]])
    out = weighted_mean(x, torch.tensor([0.5, 0.5]), mask, fallback=torch.tensor([9.0, 9.0, 9.0]))
    assert torch.allclose(out, torch.tensor([2.0, 4.0, 9.0]))


def test_mean_is_computed_in_float64():
    x = torch.tensor([[1e8 + 1.0], [1e8 - 1.0]], dtype=torch.float32)
    assert weighted_mean(x, torch.tensor([0.5, 0.5], dtype=torch.float64)).dtype == torch.float32


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"w": torch.tensor([[float("nan"), 0.0]]), "b": torch.zeros(1), "n": torch.tensor(0)}, "NaN or Inf"),
        ({"w": torch.tensor([[float("inf"), 0.0]]), "b": torch.zeros(1), "n": torch.tensor(0)}, "NaN or Inf"),
        ({"w": torch.zeros(2, 1), "b": torch.zeros(1), "n": torch.tensor(0)}, "shape"),
        ({"w": torch.zeros(1, 2), "n": torch.tensor(0)}, "missing"),
        ({"w": torch.zeros(1, 2), "b": torch.zeros(1), "n": torch.tensor(0), "x": torch.zeros(1)}, "unknown"),
    ],
)
def test_bad_updates_are_refused_with_the_client_named(bad, msg):
    ups = [_updates()[0], Upload(7, bad, 5)]
    with pytest.raises(UploadError, match=msg) as err:
        _rin(ups, GLOBAL)
    assert "client 7" in str(err.value)


def test_zero_samples_refused():
    u = _updates()[0]
    with pytest.raises(UploadError, match="num_samples"):
        _rin([Upload(0, u.params, 0)], GLOBAL)
