"""Capture a whole training step (rollout, loss, backward, optimizer step) as one CUDA graph."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

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
    ``torch.compile``'d code inside ``step_fn`` (``ExecutionConfig(compile_step=True)``) compiles in the
    first warm-up call, its backward at that call's ``backward()``, so the capture records the
    generated kernels; a guard that fails only at capture would compile during it and fail there.

    Randomness comes from ``generator``, registered with the graph: the caller reseeds it before
    each call (``generator.manual_seed(...)``) and the replay reads the new seed and offset, so the
    random numbers of a replay are the same as eager execution with the same seed.

    The graph holds raw pointers to every tensor it reads or writes. Restoring state between
    replays (a rollback) must therefore copy *into* those tensors (``param.data.copy_(...)``); a
    replaced tensor would leave the graph on stale memory. ``static_tensors`` lets the graph check
    that at every replay, and ``capture_key`` covers what it cannot see: Python numbers baked into
    the kernels at capture time, such as a capturable Adam's learning rates.

    Args:
        step_fn: the step; its returned tensors are overwritten by the next replay (clone to keep).
        generator: the CUDA generator ``step_fn`` draws from.
        warmup_steps: eager calls before capture (lets cuDNN/cuBLAS/autograd allocate their state).
        capture_key: returns the Python values the capture depends on (e.g. every optimizer
            param group's hyperparameters); when it differs from its value at capture, the next
            call captures again (without a new warm-up: that call is still one training step).
            None: captured once.
        static_tensors: returns the persistent tensors the step works on in place (parameters,
            optimizer state, recurrent state); their addresses are recorded at capture and
            checked before every replay. None: no check.

    Raises:
        ValueError: ``generator`` is not a CUDA generator, or ``warmup_steps < 1``.
        RuntimeError: (at a replay) a tensor of ``static_tensors`` was replaced since the capture.

    Example::

        optimizer = torch.optim.Adam(model.parameters(), capturable=True)
        step = GraphedTrainStep(lambda: train_step(optimizer), generator,
                                capture_key=lambda: [g["lr"] for g in optimizer.param_groups])
        for step_index in range(100):
            generator.manual_seed(step_index)
            loss = step()["loss"].clone()
    """

    def __init__(
        self,
        step_fn: Callable[[], StepOutputs],
        generator: torch.Generator,
        warmup_steps: int = 3,
        capture_key: Callable[[], Any] | None = None,
        static_tensors: Callable[[], Iterable[torch.Tensor]] | None = None,
    ) -> None:
        if generator.device.type != "cuda":
            raise ValueError(f"generator must be a CUDA generator for graph capture, got one on {generator.device}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1 (CUDA graphs need a warm-up), got {warmup_steps!r}")
        self.step_fn = step_fn
        self.generator = generator
        self.warmup_steps = warmup_steps
        self.capture_key = capture_key
        self.static_tensors = static_tensors
        self.calls = 0
        self.captures = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_outputs: StepOutputs | None = None
        self._key: Any = None
        self._addresses: tuple[int, ...] = ()

    def __call__(self) -> StepOutputs:
        self.calls += 1
        if self.calls <= self.warmup_steps:
            return self._run_on_side_stream()
        if self.graph is not None and self.capture_key is not None and self.capture_key() != self._key:
            # the old graph would replay the old constants; drop it (and its memory pool) first
            self.graph, self.static_outputs = None, None
        if self.graph is None:
            self._capture()
        else:
            self._check_addresses()
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

    def _current_addresses(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.static_tensors()) if self.static_tensors is not None else ()

    def _check_addresses(self) -> None:
        current = self._current_addresses()
        if current != self._addresses:
            moved = sum(a != b for a, b in zip(current, self._addresses)) + abs(len(current) - len(self._addresses))
            raise RuntimeError(
                f"GraphedTrainStep: {moved} of the {len(self._addresses)} tensors captured in the CUDA graph were "
                "replaced since the capture; a replay would read and write stale memory. HINT: restore state in "
                "place (`param.data.copy_(saved)`, optimizer state `.copy_`), never `load_state_dict` on the "
                "optimizer or new tensors, while a graph is captured."
            )

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(self.generator)
        key = self.capture_key() if self.capture_key is not None else None
        # Capturing records kernels without running them; the caller's replay runs this step.
        with torch.cuda.graph(graph):
            self.static_outputs = self.step_fn()
        self.graph = graph
        self.captures += 1
        self._key = key
        self._addresses = self._current_addresses()
