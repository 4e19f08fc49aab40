"""The verdict of a health check, the same on every rank, and the contract of who acts on a failed one.

:class:`~deepep_lightning.health.health_callback.NumericalHealthCallback` reads the steps since its
last check and returns a :class:`HealthVerdict`. Under DDP each rank sees its own steps, so
:func:`agree_across_ranks` makes every rank adopt the earliest bad step any rank saw (the others
with the reason ``OTHER_RANK``): a rollback then restores the same snapshot everywhere. Without a
:class:`FailureHandler` (such as :class:`~deepep_lightning.NaNRollbackCallback`) a failed check is
acted on by the health callback itself, which may raise :class:`NonFiniteError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import lightning.pytorch as pl
import torch

from deepep_lightning.health.flags import HealthReason, StepRecord

__all__ = ["FailureHandler", "HealthVerdict", "NonFiniteError", "agree_across_ranks"]


class NonFiniteError(RuntimeError):
    """Raised when a health check fails and the configured action is ``"raise"``."""


@dataclass
class HealthVerdict:
    """Result of one check over steps ``[first_step, end_step)`` (0-based optimizer-step indices)."""

    first_step: int
    end_step: int
    healthy: bool
    bad_step: int | None = None
    reason: HealthReason | None = None
    records: list[StepRecord] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if self.healthy:
            return f"steps {self.first_step}..{self.end_step - 1} healthy"
        return f"{self.reason} at step {self.bad_step} ({self.details})"


class FailureHandler(Protocol):
    """A callback that takes over failed checks from :class:`NumericalHealthCallback` (see ``attach_rollback``)."""

    @property
    def stopped(self) -> bool:
        """True once the handler has stopped training (the epoch-end checks then rest)."""
        ...

    def skips(self, step: int) -> bool:
        """Whether the handler skips optimizer step ``step`` (its loss and gradients are then not recorded)."""
        ...


def agree_across_ranks(trainer: pl.Trainer, verdict: HealthVerdict) -> HealthVerdict:
    """Make the verdict rank-consistent: all ranks adopt the earliest bad step seen by any rank."""
    if trainer.world_size <= 1 or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return verdict
    sentinel = verdict.end_step
    mine = verdict.bad_step if not verdict.healthy else sentinel
    earliest = torch.tensor([mine], dtype=torch.long, device=trainer.strategy.root_device)
    torch.distributed.all_reduce(earliest, op=torch.distributed.ReduceOp.MIN)
    earliest_step = int(earliest.item())
    all_healthy = trainer.strategy.reduce_boolean_decision(verdict.healthy, all=True)
    if all_healthy:
        return verdict
    if verdict.healthy or verdict.bad_step != earliest_step:
        verdict.healthy, verdict.bad_step = False, earliest_step
        verdict.reason = verdict.reason if verdict.bad_step == mine else HealthReason.OTHER_RANK
    return verdict
