"""Many runs from one spec: ``fedskew sweep`` and the executors that run them.

* :mod:`~fedskew.sweep.core`: the spec (axes, methods, seeds), its expansion into planned runs with stable run
  directories, their state on disk, and :func:`~fedskew.sweep.core.run_sweep`;
* :mod:`~fedskew.sweep.task`: one run as a picklable task (:class:`~fedskew.sweep.task.Task`) and its result;
* :mod:`~fedskew.sweep.pool`: the local process pool (devices, runs per GPU, SIGTERM to the workers);
* :mod:`~fedskew.sweep.ray`: the Ray executor (runs as Ray tasks across machines, results written here);
  :mod:`~fedskew.sweep.ray_task`: the task body on a node and the run files that travel.
"""
