"""The one collective the rollback needs beyond the strategy's own: the smallest and largest of an int over ranks."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

__all__: list[str] = []


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
