"""The local process pool of a sweep (``fedskew sweep --jobs N``): ``jobs`` worker processes forked from a server that
imported fedskew once, each running :func:`fedskew.sweep.task.execute_run` on one run at a time, their progress events
sent back over a queue; with plain ``cuda`` and several visible GPUs, one GPU per worker. Ctrl-C or SIGTERM lets the
running runs checkpoint and starts no new one. The Ray executor (``sweep/ray.py``) is the other way to run them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from fedskew.lifecycle import die_with_parent
from fedskew.sweep.task import Event, RunResult, Task, TaskGroup, execute, members

_QUEUE: Any = None
_DEVICE: tuple[int, int] = (0, 0)  # (this worker's index, GPUs visible)

# Runs at a time per GPU when --jobs is not given. Measured by benchmarks/runs_per_gpu.py (the run book's
# runs-per-gpu piece) on one H200 with 16 CPU cores, 2026-11-26: 8 seeds of reproduce --scale small's shape (PFLlib
# CNN, MNIST, 20 clients) 1, 2, 4 and 8 at a time gave 1.00x, 1.84x, 3.41x and 3.77x the runs per hour, with the same
# metrics at every level (docs/sweeps.md). A small model leaves the device mostly idle, so runs sharing it overlap.
RUNS_PER_GPU = 8


def default_jobs(devices: list[str | None], gpus: int | None = None, cpus: int | None = None) -> int:
    """Runs at a time when neither ``--jobs`` nor the spec says: 1 when every run is on the CPU (each run uses its
    ``threads``), else :data:`RUNS_PER_GPU` per visible GPU (per named GPU for ``cuda:N``), at most one per CPU core
    (each worker drives its runs from one core)."""
    named = {d for d in devices if d and d.startswith("cuda:")}
    if not any(d and d.startswith("cuda") for d in devices):
        return 1
    if gpus is None:
        import torch

        gpus = int(torch.cuda.device_count())
    if gpus < 1:
        return 1  # the runs fail on their own with the clear error of a missing device
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    used = len(named) if named and "cuda" not in devices else gpus
    return max(1, min(RUNS_PER_GPU * min(used, gpus), cpus))


def worker_device(device: str, index: int, gpus: int) -> str:
    """The device of pool worker ``index``: ``cuda`` with several GPUs visible is ``cuda:<index mod gpus>`` (runs
    spread one GPU per worker, round-robin); any other device stays as it is."""
    return f"cuda:{index % gpus}" if device == "cuda" and gpus > 1 else device


def terminate(pids: list[int]) -> None:
    """SIGTERM to each of ``pids`` that still exists: a run there checkpoints after its round and stops."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _init_worker(queue: Any, counter: Any = None, gpus: int = 0) -> None:
    global _QUEUE, _DEVICE
    die_with_parent()  # its parent (the fork server, which ends with the sweep): a kill -9 leaves no run behind
    _QUEUE = queue
    if counter is not None:
        with counter.get_lock():
            _DEVICE, counter.value = (counter.value, gpus), counter.value + 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # between runs; a run installs its own checkpointing handler


def _pool_task(unit: Task | TaskGroup) -> list[RunResult]:
    def placed(task: Task) -> Task:
        device = task.values.get("device")
        if device == "cuda" and worker_device(device, *_DEVICE) != device:
            return Task(task.name, {**task.values, "device": worker_device(device, *_DEVICE)}, task.state)
        return task

    unit = TaskGroup(tuple(placed(t) for t in unit.tasks)) if isinstance(unit, TaskGroup) else placed(unit)
    return execute(unit, _QUEUE.put)


def _visible_gpus(todo: list[Task | TaskGroup]) -> int:
    """GPUs to spread the pool's runs over: counted only when some run asks for plain ``cuda``."""
    if not any(t.values.get("device") == "cuda" for t in todo):
        return 0
    import torch

    return int(torch.cuda.device_count())


def mp_context() -> Any:
    import multiprocessing as mp

    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")  # workers fork from a clean server: no inherited threads or locks
        ctx.set_forkserver_preload(["fedskew.runner"])
        return ctx
    return mp.get_context("spawn")


def run_pool(
    todo: list[Task | TaskGroup],
    jobs: int,
    emit: Callable[[Event], None],
    results: dict[str, RunResult],
    report: Callable[[RunResult], None],
) -> bool:
    from concurrent.futures import CancelledError, ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    ctx = mp_context()
    queue = ctx.Queue()
    pids: dict[str, int] = {}

    def drain() -> None:
        while (ev := queue.get()) is not None:
            if ev[0] == "start":
                pids[ev[1]] = ev[4]
            emit(ev)

    listener = threading.Thread(target=drain, daemon=True)
    listener.start()
    interrupted = False
    on_main = threading.current_thread() is threading.main_thread()

    def forward_term(signum: int, frame: object) -> None:  # SIGTERM to the sweep: the running runs checkpoint
        terminate(list(pids.values()))
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, forward_term) if on_main else None

    worker_args = (queue, ctx.Value("i", 0), _visible_gpus(todo))

    def new_pool() -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_init_worker, initargs=worker_args)

    pool = new_pool()
    waiting = list(reversed(todo))  # submitted only as workers free up: after Ctrl-C no new run starts
    running: dict[Any, Task | TaskGroup] = {}

    def finish(task: Task, res: RunResult) -> None:
        pids.pop(task.name, None)
        results[task.name] = res
        report(res)

    def finish_unit(unit: Task | TaskGroup, got: list[RunResult]) -> None:
        by_name = {r.name: r for r in got}
        for task in members(unit):
            out = str(task.values.get("out"))
            finish(task, by_name.get(task.name) or RunResult(task.name, "failed", out, error="no result came back"))

    def step() -> bool:
        """Submit what fits, wait for one run, record it; False when nothing is left."""
        nonlocal pool, interrupted
        while waiting and len(running) < jobs and not interrupted:
            task = waiting.pop()
            try:
                fut = pool.submit(_pool_task, task)
            except BrokenProcessPool:  # a worker died earlier: the others went with it; start fresh ones
                pool.shutdown(wait=False, cancel_futures=True)
                pool = new_pool()
                fut = pool.submit(_pool_task, task)
            running[fut] = task
        if interrupted:
            for unit in reversed(waiting):
                for task in members(unit):
                    finish(task, RunResult(task.name, "not started", str(task.values.get("out"))))
            waiting.clear()
        if not running:
            return False
        fut = next(as_completed(running))
        unit = running.pop(fut)
        try:
            got: list[RunResult] = fut.result()
        except (CancelledError, BrokenProcessPool):
            got = [
                RunResult(
                    task.name,
                    "failed",
                    str(task.values.get("out")),
                    error="its worker process died (killed, or out of memory?); run the sweep again to resume it "
                    "from its last checkpoint",
                )
                for task in members(unit)
            ]
        interrupted = interrupted or any(r.status == "interrupted" for r in got)
        finish_unit(unit, got)
        return True

    try:
        while True:
            try:
                if not step():
                    break
            except KeyboardInterrupt:  # the workers got the signal too: their runs checkpoint after this round
                interrupted = True
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        queue.put(None)
        listener.join(timeout=5)
    return interrupted
