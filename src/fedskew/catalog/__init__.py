"""The built-in methods, one module each: a method's hyper-parameter schema, client part (with its batched form),
server half and pieces, the tensors it exchanges and its registration live in one file, which reads like its paper's
algorithm box. A family that shares its server half keeps its members together (FedProto and FedProc; FedDyn, FedDC
and their cloud step; AFL, q-FFL and FedFV).

Each module defines ``CLIENTS`` (name -> :class:`fedskew.registry.ClientPart`) and ``SERVER_PLUGINS``
(name -> :class:`fedskew.registry.ServerPlugin`), and optionally ``ALIASES``; :mod:`fedskew.methods` registers them
in the order of :data:`CATALOGS`. A module imports the generic machinery only (``fedskew.client.local``,
``fedskew.client.batched_form``, ``fedskew.client.kernels``, ``fedskew.server.api`` and the shared combines), never
:mod:`fedskew.methods` nor another method's module. Adding a method is adding a module here and its name to
:data:`CATALOGS` (or, outside fedskew, ``fedskew.register`` / an entry point: docs/extending.md).
"""

from fedskew.catalog import (
    apfl,
    ccvr,
    disco,
    ditto,
    drift,
    fairness,
    fedala,
    fedamp,
    fedavg,
    fedavgm,
    fedbabu,
    fedcac,
    feddbe,
    feddecorr,
    fedexp,
    fedgen,
    fednova,
    fedntd,
    fedopt,
    fedprox,
    fedrep,
    fedrod,
    fedsa,
    fedsam,
    fpl,
    heal,
    keep_local,
    label_calibration,
    moon,
    perfedavg,
    pfedme,
    prototypes,
    scaffold,
)

CATALOGS = (
    fedavg,
    fedprox,
    moon,
    scaffold,
    fedrep,
    ditto,
    disco,
    fedsa,
    heal,
    keep_local,
    fedcac,
    fedamp,
    fedavgm,
    fedopt,
    fedexp,
    fednova,
    drift,
    fedntd,
    fedgen,
    fedbabu,
    fedala,
    prototypes,
    fairness,
    feddecorr,
    label_calibration,
    fedsam,
    ccvr,
    fpl,
    fedrod,
    feddbe,
    apfl,
    perfedavg,
    pfedme,
)
