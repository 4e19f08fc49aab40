"""What the plugin asks of a LightningModule or a callback beyond Lightning's own hooks.

Every method here is optional: the plugin checks for it with ``isinstance(obj, Protocol)`` and works
without it. A workload implements what it needs; the plugin never looks at class names.

* :class:`RolloutStateful` — state that lives outside parameters and buffers but decides the next
  step (an RL agent's environments and recurrent state, a streaming data cursor). Snapshots,
  rollback and checkpoints carry it; under ``DeterministicDDPStrategy`` it is kept per rank under
  :data:`ROLLOUT_STATE_KEY`.
* :class:`UncapturedSteps` — a module that runs its step inside a CUDA graph can run it eagerly on
  request, so the non-finite locator sees the ops inside the graph.
* :class:`ReplayAware` — a callback that must re-prepare a step before it is run again (a replay
  after a rollback, a diagnosis run), e.g. to reseed it exactly as the first time.

Example::

    class MyModule(pl.LightningModule):
        def rollout_state_dict(self) -> dict[str, Any]:
            return {"cursor": self.cursor.clone()}

        def load_rollout_state_dict(self, state: dict[str, Any]) -> None:
            self.cursor.copy_(state["cursor"])  # in place: a captured graph may point at it
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl

__all__ = ["ROLLOUT_STATE_KEY", "ReplayAware", "RolloutStateful", "UncapturedSteps"]

#: Top-level checkpoint key under which a :class:`RolloutStateful` module's state is saved.
ROLLOUT_STATE_KEY = "rollout_state"


@runtime_checkable
class RolloutStateful(Protocol):
    """State outside parameters that a replay must restore to recompute the same steps."""

    def rollout_state_dict(self) -> dict[str, Any]:
        """Tensors and plain values; empty when there is nothing yet (before the first step)."""
        ...

    def load_rollout_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`rollout_state_dict` returned, copying into live tensors where they exist."""
        ...


@runtime_checkable
class UncapturedSteps(Protocol):
    """A module whose step normally replays a CUDA graph, and can run it eagerly instead."""

    def uncaptured_steps(self) -> contextlib.AbstractContextManager[None]:
        """Inside this context ``training_step`` runs eagerly, op by op, with the same result."""
        ...


@runtime_checkable
class ReplayAware(Protocol):
    """A callback told before a training step is run a second time (replay or diagnosis)."""

    def on_replay_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, epoch: int
    ) -> None:
        """Called instead of ``on_train_batch_start`` before step ``batch_idx`` of ``epoch`` is re-run."""
        ...
