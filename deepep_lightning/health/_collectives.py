"""What the rollback agrees on over ranks beyond the strategy's own collectives: an int's range, the snapshot to use."""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import lightning.pytorch as pl
import torch

from deepep_lightning.health.events import EventKind
from deepep_lightning.health.snapshot import Snapshot, SnapshotRing

__all__: list[str] = []


class EmitEvent(Protocol):
    """Records one health event (:meth:`~deepep_lightning.health.events.HealthEventLog.emit` with its log bound)."""

    def __call__(
        self, trainer: pl.Trainer, kind: EventKind, step: int, announce: bool = True, **fields: Any
    ) -> dict[str, Any]: ...


def distributed(trainer: pl.Trainer) -> bool:
    """True when ranks must agree (several processes in an initialised process group)."""
    return trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def min_max_over_ranks(trainer: pl.Trainer, value: int) -> tuple[int, int]:
    """``(min, max)`` of ``value`` over all ranks, in one all-reduce (``(value, value)`` alone)."""
    if not distributed(trainer):
        return value, value
    both = torch.tensor([value, -value], dtype=torch.long, device=trainer.strategy.root_device)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MIN)
    low, negative_high = both.tolist()
    return int(low), int(-negative_high)


def newest_snapshot_on_every_rank(
    trainer: pl.Trainer, ring: SnapshotRing, emit: EmitEvent, before_step: int | None = None
) -> Snapshot | None:
    """The newest snapshot that **every** rank can load (with ``step < before_step`` when given), or None.

    Each rank proposes the newest one it can load; while the proposals differ, every rank looks
    again at or below the smallest (a corrupt file on one rank makes all fall back together, so
    the replays keep the same length and the collectives stay matched). None on all ranks when
    one rank has none. A corrupt file is reported through ``emit`` and warned about.
    """

    def on_corrupt(path: str, error: Exception) -> None:
        emit(trainer, EventKind.CORRUPT_SNAPSHOT, trainer.global_step, path=path, error=str(error))
        warnings.warn(f"NaNRollbackCallback: {error}; falling back to the previous snapshot.", stacklevel=2)

    limit = before_step
    while True:
        snapshot = ring.latest(on_corrupt, limit)
        low, high = min_max_over_ranks(trainer, snapshot.step if snapshot is not None else -1)
        if low == high:
            return snapshot
        if low < 0:
            return None
        limit = low + 1
