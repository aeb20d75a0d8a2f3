"""Built-in method parts beyond the core set, one module per family of papers.

Each module defines ``CLIENTS`` (name -> :class:`fedskew.registry.ClientPart`) and ``SERVER_PLUGINS``
(name -> :class:`fedskew.registry.ServerPlugin`), and optionally ``ALIASES``; :mod:`fedskew.methods` registers them
with the core parts. A module never imports :mod:`fedskew.methods`.

* :mod:`~fedskew.catalog.drift`: hosts and server optimizers of the FedDisco paper (FedDyn, FedDC, FedNova, FedAvgM);
* :mod:`~fedskew.catalog.baselines`: the FedSA/FedPake paper's baselines (FedNTD, FedGen, FedBABU, FedALA);
* :mod:`~fedskew.catalog.fairness`: the FedHEAL paper's comparisons (FedProto, FedProc, AFL, q-FFL, FedFV).
"""

from fedskew.catalog import baselines, drift, fairness

CATALOGS = (drift, baselines, fairness)
