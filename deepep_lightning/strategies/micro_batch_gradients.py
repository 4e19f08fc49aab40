"""Micro-batch gradients kept apart and added in virtual-rank order: 1, 2 and 4 processes give the same bits.

In world-size-invariant mode (``virtual_world_size=K``) a process of ``W`` accumulates ``K / W``
micro-batches. Left to autograd and DDP, the ``K`` gradients are added in an order that depends
on ``W``: one process adds ``((g0 + g1) + g2) + g3`` (``AccumulateGrad``), two processes
``(g0 + g1) + (g2 + g3)`` (local accumulation, then the all-reduce). :class:`MicroBatchGradients`
keeps each micro-batch's gradient in a row of its own (the ``.grad`` tensors are zeroed after each
backward; DDP's own all-reduce is off), gathers the rows of every process at the window's last
micro-batch (rank-major: row ``v`` is virtual rank ``v``) and adds them in order, so every ``W``
performs the additions of the single process. Lightning scales a micro-batch's loss by ``W / K``,
and the sum is divided by ``W``; for ``K`` a power of two both scalings are exact, so the result is
the single process's bit for bit.

Cost: a process holds ``K / W`` flat copies of the gradients and receives ``(W - 1) K / W`` of
them at each optimizer step (the all-reduce moves about two); in one process there is no
communication, only the copies.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepep_lightning.strategies.ordered_reduction import ordered_sum

__all__ = ["MicroBatchGradients"]


class MicroBatchGradients:
    """The gradients of one accumulation window, one row per micro-batch.

    Args:
        parameters: the parameters whose ``.grad`` are kept (those that require gradients).
        micro_batches: micro-batches per process and window (``K / W``).
        world_size: processes (``W``); above 1, a process group must be initialised.
    """

    def __init__(self, parameters: list[torch.nn.Parameter], micro_batches: int, world_size: int) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        self.micro_batches = int(micro_batches)
        self.world_size = int(world_size)
        self._rows: torch.Tensor | None = None  # [micro_batches, numel]

    def _flat_grads(self) -> torch.Tensor:
        grads = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            for p in self.parameters
        ]
        return torch.cat(grads)

    def keep(self, index: int) -> None:
        """Store the current ``.grad`` as micro-batch ``index`` of the window and zero ``.grad``."""
        flat = self._flat_grads()
        if self._rows is None:
            self._rows = flat.new_zeros((self.micro_batches, flat.numel()))
        self._rows[index].copy_(flat)
        for p in self.parameters:
            if p.grad is not None:
                p.grad.zero_()

    def reduce_into_grads(self) -> None:
        """Gather every process's rows, add them in virtual-rank order, divide by ``W``, write ``.grad``."""
        assert self._rows is not None, "keep() runs before reduce_into_grads()"
        rows = self._rows
        if self.world_size > 1:
            gathered = rows.new_empty((self.world_size * self.micro_batches, rows.shape[1]))
            dist.all_gather_into_tensor(gathered, rows)
            rows = gathered
        total = ordered_sum(rows)
        if self.world_size > 1:
            total.div_(self.world_size)
        offset = 0
        for p in self.parameters:
            piece = total[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = piece.clone()
            else:
                p.grad.copy_(piece)
            offset += p.numel()
