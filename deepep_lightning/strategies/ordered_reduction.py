"""Gradient averaging whose bits do not depend on DDP's bucket layout or on the node layout.

DDP's all-reduce sums a gradient element over the ranks in an order set by the element's offset
in its bucket (a ring all-reduce starts each chunk at another rank) and by the ring the backend
builds for the topology. The bucket layout itself changes during a run: the first step after DDP
wraps the model reduces one bucket of all parameters in definition order, and later steps reduce
buckets rebuilt in the order the gradients became ready (``DistributedDataParallel``'s bucket
rebuild). With two ranks each element is one addition, ``a + b = b + a``, so the order never
matters; with three or more, the first step after a resume reduces in another order than the same
step of the uninterrupted run, and a run on another node layout may get another ring.

:func:`ordered_mean_hook` is a DDP communication hook that gathers every rank's bucket
(``all_gather_into_tensor``: data movement only, exact) and adds the copies in rank order,
``((g0 + g1) + g2) + ...``, then divides by the world size: the same bits whatever the bucket
layout, the restart history, the ring or the node layout. The cost is the gather: each rank
receives ``world_size - 1`` copies of a bucket instead of the ring's ``2 (world_size - 1) /
world_size``, i.e. ``world_size / 2`` times the traffic, and holds ``world_size`` copies of one
bucket at a time.
"""

# no ``from __future__ import annotations``: DDP checks the hook's annotations as objects
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ordered_mean_hook", "ordered_sum"]


def ordered_sum(rows: torch.Tensor) -> torch.Tensor:
    """``((rows[0] + rows[1]) + rows[2]) + ...`` elementwise, in that order (a fresh tensor)."""
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total


def ordered_mean_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the mean over ranks, summed in rank order (see the module docstring).

    Register it with ``ddp_model.register_comm_hook(process_group_or_None, ordered_mean_hook)``;
    :class:`~deepep_lightning.strategies.DeterministicDDPStrategy` does so when its
    ``gradient_reduction`` is ``"ordered"``.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    buffer = bucket.buffer()
    gathered = buffer.new_empty(world_size * buffer.numel())
    work = dist.all_gather_into_tensor(gathered, buffer.reshape(-1), group=group, async_op=True)
    assert work is not None  # async_op=True returns the work handle

    def reduce(future: torch.futures.Future[Any]) -> torch.Tensor:
        future.wait()
        return ordered_sum(gathered.view(world_size, -1)).div_(world_size).view_as(buffer)

    return work.get_future().then(reduce)
