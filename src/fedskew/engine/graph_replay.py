"""A step replayed as CUDA graphs, one per shape (:mod:`fedskew.engine.captured`): warmed up eagerly on a side
stream, captured on its second use, replayed after; anywhere but a CUDA device the step just runs."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable

import torch


class StepReplay:
    """Runs ``step(shape)`` for each step: on a CUDA device each shape's step captured as a CUDA graph on its second
    use (its first runs eagerly on a side stream: the warm-up the capture needs) and replayed after; elsewhere eagerly.
    Everything runs with ``device`` current (its streams, its memory pool: a run on ``cuda:1`` captures there, not on
    the process's current device). A capture that fails warns with the reason, puts back the stream that was current
    (a capture that raises can leave its own stream current) and the phase goes on eagerly (the step reads and writes
    only the buffers it is given, so an eager step and a replay do the same)."""

    def __init__(self, step: Callable[[Hashable], None], device: torch.device) -> None:
        self.step = step
        self.device = device
        self.capture = device.type == "cuda"
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.warm: set[Hashable] = set()
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.stream = torch.cuda.Stream(device) if self.capture else None  # the warm-ups' and captures' stream

    def __call__(self, key: Hashable) -> None:
        if not self.capture:
            self.step(key)
            return
        with torch.cuda.device(self.device):
            self._on_device(key)

    def _on_device(self, key: Hashable) -> None:
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        current = torch.cuda.current_stream(self.device)
        if key not in self.warm:
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                self.step(key)
            current.wait_stream(self.stream)
            self.warm.add(key)
            return
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                self.step(key)
        except RuntimeError as err:
            torch.cuda.set_stream(current)
            torch.cuda.synchronize(self.device)
            warnings.warn(f"batched step capture failed ({err}); running the steps eagerly", stacklevel=3)
            self.capture = False
            self.step(key)
            return
        self.graphs[key] = graph
        graph.replay()  # the capture recorded the step without running it
