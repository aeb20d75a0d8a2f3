"""FedAvg (McMahan, Moore, Ramage, Hampson, Agüera y Arcas, AISTATS 2017): plain local SGD on the cross-entropy
(:class:`~fedskew.client.local.LocalAlgorithm` itself), and the server's weighted average.

The average's weights are the resolver's ``weights`` setting (``samples``: sample shares, the paper's; ``uniform``:
1/K, the control every comparison with a weighting method includes), which every composition shares.
"""

from __future__ import annotations

from fedskew.client.local import LocalAlgorithm
from fedskew.registry import ClientPart, NoParams, ServerPlugin

CLIENTS: dict[str, ClientPart] = {
    "fedavg": ClientPart(
        "fedavg",
        "plain local SGD on cross-entropy; server averages with sample-share weights (weights=uniform: 1/K)",
        "McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017",
        NoParams,
        lambda p: LocalAlgorithm(),
    ),
}
SERVER_PLUGINS: dict[str, ServerPlugin] = {}
