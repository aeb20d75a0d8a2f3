"""Hyper-parameter search on validation data (``fedskew tune``) and its product, ``tuned.yaml``.

* :mod:`~fedskew.space`: the search-space types method parts declare their tunable hyper-parameters with
  (:attr:`fedskew.registry.ClientPart.tunable`) and override strings (``--space mu=log:1e-4..1``);
* :mod:`~fedskew.tuning.method_space`: a composition's space from its parts' declarations and the overrides;
* :mod:`~fedskew.tuning.tuned`: ``tuned.yaml`` (best arguments per method and setting), read and applied by
  ``fedskew sweep --tuned`` and ``fedskew reproduce --tuned``;
* :mod:`~fedskew.tuning.spec`: a search's settings (spec file and flags), validated before anything runs;
* :mod:`~fedskew.tuning.trials`: one trial: its runs on the validation splits, the pruning curve, the objective;
* :mod:`~fedskew.tuning.study`: the studies, one per method, with Optuna (the optional extra ``fedskew[tune]``):
  storage, resumption, parallel processes, the trials table, ``tuned.yaml`` and the figures
  (:mod:`~fedskew.tuning.plots`);
* :mod:`~fedskew.tuning.storage`: the studies' storage (heartbeats, retries, and queued trials claimed by exactly one
  process on an SQLite file).

Only the study, trial and storage modules import Optuna (the first two inside their functions, the storage module
when a search opens its storage), so a sweep that applies a ``tuned.yaml`` needs nothing beyond fedskew.
"""
