"""Flower (``flwr``) as fedskew's distributed engine: any method composition in a real federation, same numbers.

The only place in fedskew that imports ``flwr`` (the optional extra ``pip install -e ".[flower]"``). The apps run the
objects the simulator runs, nothing re-implemented: the ClientApp calls :func:`fedskew.engine.rounds.train_client`
with the method's :class:`~fedskew.client.local.LocalAlgorithm`; the ServerApp holds the simulator's round server
(:class:`~fedskew.engine.round_server.RoundServer`) and its clients are Flower nodes (its round opens, takes uploads
and closes with the simulator's own code, the method's :class:`~fedskew.server.api.ServerStrategy` aggregating).

* :mod:`fedskew.flower.settings` run-config <-> :class:`~fedskew.config.RunConfig` and the app folder's
                                 ``pyproject.toml`` (no ``flwr`` needed: ``fedskew flower new``);
* :mod:`fedskew.flower.codec`    tensors <-> ``ArrayRecord``, a client's persistent state <-> ``context.state``;
* :mod:`fedskew.flower.client_app` the ClientApp: ``query.hello`` (its label histograms and sample count, once),
                                 ``train`` (one round of local training), ``evaluate`` (its scores per view);
* :mod:`fedskew.flower.server_app` the ServerApp: its own round loop over the Grid, the run directory and database;
* :mod:`fedskew.flower.inprocess` a Grid that calls the ClientApp in this process (no network, no Ray): tests, and
                                 ``fedskew flower local``;
* :mod:`fedskew.flower.loopback` SuperLink + SuperNodes as processes on 127.0.0.1 and ``flwr run`` (tests, docs).
* :mod:`fedskew.flower.strategies` FedDisco, FedHEAL, FedSA/FedPake and any composition as subclasses of Flower's own
                                 ``FedAvg`` strategy, for an existing Flower app (quickstart ClientApps unchanged).

See docs/flower.md.
"""

from __future__ import annotations

FLOWER_SPEC = "flwr>=1.41,<1.43"
INSTALL_HINT = (
    f'the Flower engine needs the optional extra: pip install -e ".[flower]" (or pip install "{FLOWER_SPEC}")'
)


class FlowerMissingError(ImportError):
    """``flwr`` is not installed; the message says how to install the extra."""


def require_flwr() -> None:
    """Raise :class:`FlowerMissingError` with the install command when ``flwr`` cannot be imported."""
    import importlib.util

    if importlib.util.find_spec("flwr") is None:
        raise FlowerMissingError(INSTALL_HINT)
