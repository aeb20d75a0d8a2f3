"""Hyper-parameter search on validation data (``fedskew tune``) and its product, ``tuned.yaml``.

* :mod:`~fedskew.tuning.space`: the search-space types method parts declare their tunable hyper-parameters with
  (:attr:`fedskew.registry.ClientPart.tunable`), override strings (``--space mu=log:1e-4..1``), and a method's space;
* :mod:`~fedskew.tuning.tuned`: ``tuned.yaml`` (best arguments per method and setting), read and applied by
  ``fedskew sweep --tuned`` and ``fedskew reproduce --tuned``;
* :mod:`~fedskew.tuning.study`: the search itself, with Optuna (the optional extra ``fedskew[tune]``).

Only the last imports Optuna, so a sweep that applies a ``tuned.yaml`` needs nothing beyond fedskew.
"""
