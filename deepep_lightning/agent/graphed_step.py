"""Capture a whole training step (rollout, loss, backward, optimizer step) as one CUDA graph."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["GraphedTrainStep"]

StepOutputs = dict[str, torch.Tensor]


class GraphedTrainStep:
    """Run ``step_fn`` eagerly for ``warmup_steps`` calls, then capture it once and replay it.

    ``step_fn`` must do the whole step — forward, backward and the optimizer step, with an optimizer
    built with ``capturable=True`` — on static shapes without host syncs, update persistent state
    in place, and return a dict of tensors. Every call is one real training step: the warm-up calls
    (on a side stream, as CUDA graphs require) train too, and the capture call captures *and then
    replays*, so call ``k`` of the graphed step equals call ``k`` of plain eager execution.

    Randomness comes from ``generator``, registered with the graph: the caller reseeds it before
    each call (``generator.manual_seed(...)``) and the replay reads the new seed and offset, so the
    random numbers of a replay are the same as eager execution with the same seed.

    Args:
        step_fn: the step; its returned tensors are overwritten by the next replay (clone to keep).
        generator: the CUDA generator ``step_fn`` draws from.
        warmup_steps: eager calls before capture (lets cuDNN/cuBLAS/autograd allocate their state).
    """

    def __init__(self, step_fn: Callable[[], StepOutputs], generator: torch.Generator, warmup_steps: int = 3) -> None:
        if generator.device.type != "cuda":
            raise ValueError(f"generator must be a CUDA generator for graph capture, got one on {generator.device}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 (CUDA graphs need a warm-up), got {warmup_steps!r}")
        self.step_fn = step_fn
        self.generator = generator
        self.warmup_steps = warmup_steps
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_outputs: StepOutputs | None = None

    def __call__(self) -> StepOutputs:
        self.calls += 1
        if self.calls <= self.warmup_steps:
            return self._run_on_side_stream()
        if self.graph is None:
            self._capture()
        assert self.graph is not None and self.static_outputs is not None
        self.graph.replay()
        return self.static_outputs

    def _run_on_side_stream(self) -> StepOutputs:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outputs = self.step_fn()
        torch.cuda.current_stream().wait_stream(side)
        return outputs

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(self.generator)
        # Capturing records kernels without running them; the caller's replay runs this step.
        with torch.cuda.graph(graph):
            self.static_outputs = self.step_fn()
        self.graph = graph
