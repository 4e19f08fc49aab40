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
* :class:`SequenceAuditable` — a module whose ``training_step`` runs a whole sequence (an RL
  rollout): ``deepep-audit`` L2 is then one timestep, L3 one sequence, each a single
  ``training_step``; it also names the module's audit variants and its seed argument.
* :class:`MonitorsMetrics` — a callback that reads logged metrics from ``trainer.callback_metrics`` at
  steps of its own choosing; :func:`monitored_metrics` collects their names (and every callback's
  ``monitor`` attribute, as ``ModelCheckpoint`` and ``EarlyStopping`` have it), so a module that logs
  some scalars only at the steps Lightning writes keeps those current at every step.

What a training step returns is Lightning's own contract (a loss tensor, or a mapping with
``"loss"``); :func:`step_loss` reads it, and :func:`step_grad_norm` reads the ``"grad_norm"`` a
manually optimised step (e.g. one CUDA graph) reports in place of gradients no hook sees.
:func:`attached_trainer` gives a module's Trainer, or ``None`` outside one, for state a module builds
lazily (per rank, per strategy) in hooks that also run without a Trainer.

Example::

    class MyModule(pl.LightningModule):
        def rollout_state_dict(self) -> dict[str, Any]:
            return {"cursor": self.cursor.clone()}

        def load_rollout_state_dict(self, state: dict[str, Any]) -> None:
            self.cursor.copy_(state["cursor"])  # in place: a captured graph may point at it
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import lightning.pytorch as pl
from torch import Tensor

from deepep_lightning import _lightning_compat

__all__ = [
    "GRAD_NORM_KEY",
    "ROLLOUT_STATE_KEY",
    "AuditLevel",
    "MonitorsMetrics",
    "ReplayAware",
    "RolloutStateful",
    "SequenceAuditable",
    "UncapturedSteps",
    "attached_trainer",
    "counted_optimizer_step",
    "monitored_metrics",
    "step_grad_norm",
    "step_loss",
]

#: Top-level checkpoint key under which a :class:`RolloutStateful` module's state is saved.
ROLLOUT_STATE_KEY = "rollout_state"

#: Key of a training step's outputs holding the total gradient norm (manual optimisation).
GRAD_NORM_KEY = "grad_norm"

#: The in-process levels of the verification pyramid: one step (L2), one whole sequence (L3).
AuditLevel = Literal["L2", "L3"]


def attached_trainer(module: pl.LightningModule | None) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, or ``None`` (where ``module.trainer`` would raise).

    Example::

        trainer = attached_trainer(self)
        rank = trainer.global_rank if trainer is not None else 0
    """
    return _lightning_compat.attached_trainer(module)


#: Lightning's bookkeeping of one optimizer step taken outside ``LightningOptimizer.step`` (a step replayed from a
#: CUDA graph), as a context manager: ``with counted_optimizer_step(lightning_optimizer): ...``.
counted_optimizer_step = _lightning_compat.counted_optimizer_step


def step_loss(output: Any) -> Tensor | None:
    """The loss of a ``training_step`` output: the tensor itself, or its ``"loss"`` entry; else None."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


def step_grad_norm(output: Any) -> Tensor | None:
    """The ``"grad_norm"`` tensor a manually optimised step reports in its outputs; else None."""
    value = output.get(GRAD_NORM_KEY) if isinstance(output, Mapping) else None
    return value if isinstance(value, Tensor) else None


@runtime_checkable
class MonitorsMetrics(Protocol):
    """A callback that reads logged metrics from ``trainer.callback_metrics`` at steps of its own choosing."""

    def monitored_metrics(self) -> Collection[str]:
        """The names it reads (empty when it reads none)."""
        ...


def monitored_metrics(trainer: pl.Trainer) -> frozenset[str]:
    """The metric names ``trainer``'s callbacks read: :class:`MonitorsMetrics` and every ``monitor`` attribute.

    Example::

        every_step = monitored_metrics(trainer)  # {"val/loss"} with ModelCheckpoint(monitor="val/loss")
    """
    names: set[str] = set()
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # Trainer.callbacks is set outside __init__
        if isinstance(callback, MonitorsMetrics):
            names.update(callback.monitored_metrics())
        monitor = getattr(callback, "monitor", None)
        if isinstance(monitor, str):
            names.add(monitor)
    return frozenset(names)


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


@runtime_checkable
class SequenceAuditable(Protocol):
    """A module class whose one ``training_step`` is a whole sequence, audited per timestep (L2) and sequence (L3).

    Checked on the class (``isinstance(cls, SequenceAuditable)``): the audit asks before it builds
    the module. Without it, L2 is one ``training_step`` and L3 several optimizer steps.
    """

    #: The constructor argument that LightningCLI's ``seed_everything`` is linked to (e.g. ``"seed"``).
    seed_argument: str

    @classmethod
    def audit_config(cls, config: dict[str, Any], level: AuditLevel) -> dict[str, Any]:
        """Constructor kwargs for ``level``: L2 shortens the sequence to one timestep, L3 keeps it."""
        ...

    @classmethod
    def audit_describe(cls, config: dict[str, Any], level: AuditLevel) -> str:
        """What one audited ``training_step`` covers under ``config``, e.g. ``"one timestep"``."""
        ...

    @classmethod
    def audit_variants(cls) -> dict[str, dict[str, Any]]:
        """Named constructor-kwarg overrides to audit side by side, e.g. a reference and a fused kernel."""
        ...
