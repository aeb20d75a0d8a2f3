"""The model a method's global views score when it calibrates the global model post hoc (CCVR): every client's
additive statistics of its training features under the global model, summed, handed to the method's
:class:`~fedskew.server.api.Calibration`. Training never sees the calibrated model (the clients receive the global
one); the simulator computes the statistics on each client's own training split, as each client would."""

from __future__ import annotations

import copy

import torch
from torch import nn

from fedskew.data.pools import FederatedData
from fedskew.protocol import Params
from fedskew.server.api import Calibration, CalibrationKey


@torch.no_grad()
def calibrated_model(
    calibration: Calibration,
    model: nn.Module,
    data: FederatedData,
    global_params: Params,
    key: CalibrationKey,
    batch_size: int,
) -> Params:
    """``calibration``'s model from the global one and every client's training-feature statistics (the body in
    eval mode, ``batch_size`` samples per pass; the model's mode is restored)."""
    was_training = model.training
    model.load_state_dict(global_params)
    model.eval()
    total: Params = {}
    try:
        for c in data.clients:
            x, y = c.x_train, c.y_train
            if x.shape[0] == 0:
                continue
            feats = torch.cat([model.body(x[i : i + batch_size]).flatten(1) for i in range(0, x.shape[0], batch_size)])
            stats = calibration.statistics(feats, y, data.num_classes)
            total = stats if not total else {k: total[k] + v for k, v in stats.items()}
    finally:
        model.train(was_training)
    with torch.enable_grad():
        return calibration.calibrate(global_params, copy.deepcopy(model.head), total, key)
