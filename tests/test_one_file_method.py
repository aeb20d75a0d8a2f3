"""A method written in one file (examples/one_file_method.py: FedDecorr) registers, composes with a server plug-in
and trains on the batched path as on the sequential one, without a line of the engine knowing it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from test_batched_clients import _same_states, _same_updates, _side_by_side

from fedskew.catalog.disco import DiscoWeights
from fedskew.engine.batched import batchable
from fedskew.methods import resolve_method
from fedskew.models import build_model
from fedskew.registry import CLIENTS, unregister

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "one_file_method.py"


@pytest.fixture(scope="module")
def decorr():
    spec = importlib.util.spec_from_file_location("one_file_method", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        unregister("my_feddecorr")


def test_the_one_file_method_registers_and_composes(decorr):
    assert CLIENTS["my_feddecorr"] is decorr.PART
    method = resolve_method("my_feddecorr+disco", {"beta": 0.3})
    assert isinstance(method.client, decorr.FedDecorr) and method.client.beta == 0.3
    assert isinstance(method.server.weighting, DiscoWeights)
    assert batchable(method, build_model("mlp", in_channels=1, image_size=8, num_classes=10)) is None


def test_its_penalty_on_stacked_batches_is_the_per_batch_penalty(decorr):
    feats = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(0)).relu()
    rows = torch.stack([decorr.decorrelation(f) for f in feats])
    assert torch.equal(decorr.decorrelation(feats), rows)
    assert decorr.decorrelation(feats[:, :1]).tolist() == [0.0, 0.0, 0.0]  # one sample: 0, as the official loss


def test_it_trains_batched_as_sequentially(decorr):
    """Two rounds of FedDecorr + FedDisco on both paths agree within 1e-5 (uploads and client states). beta is small
    here: at beta 0.1 the penalty's 1/sqrt(var + 1e-8) on nearly dead ReLU features makes the sequential loop itself
    move by 0.19 when its received model moves by one ulp (measured), so no two float orders could agree."""
    for capture in (False, True):  # in buckets, and at padded shapes (its PaddedTerm over the real samples)
        seq, bat, rounds = _side_by_side("my_feddecorr+disco", {"beta": 1e-4}, rounds=2, capture=capture)
        for _, _, ups_seq, ups_bat in rounds:
            _same_updates(ups_seq, ups_bat)
        _same_states(seq.client_states, bat.client_states)


def test_the_comparison_sees_the_penalty(decorr):
    """The equivalence above is not vacuous: the penalty moves the uploads well beyond the tolerance."""
    _, _, with_term = _side_by_side("my_feddecorr", {"beta": 1e-4}, rounds=1)
    _, _, without = _side_by_side("my_feddecorr", {"beta": 0.0}, rounds=1)
    a, b = with_term[0][2][0].params, without[0][2][0].params
    assert max((a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point()) > 1e-5
