"""How DeterministicDDPStrategy averages the gradients: rank order, DDP's all-reduce, or micro-batch rows.

``gradient_reduction="auto"`` picks the rank-ordered sum
(:func:`~deepep_lightning.strategies.ordered_reduction.ordered_mean_hook`) from three ranks on, where
a ring all-reduce sums in an order set by DDP's bucket layout, and DDP's own all-reduce below, where
both are exact; a ``ddp_comm_hook`` the user passes is kept. In world-size-invariant mode with
several micro-batches per process, :class:`~deepep_lightning.strategies.micro_batch_gradients.MicroBatchGradients`
adds the micro-batches in virtual-rank order and DDP's own all-reduce stays off.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
from torch.nn.parallel import DistributedDataParallel

from deepep_lightning.strategies.micro_batch_gradients import MicroBatchGradients
from deepep_lightning.strategies.ordered_reduction import ordered_mean_hook

__all__ = ["GRADIENT_REDUCTIONS", "GradientReduction", "install_gradient_reduction", "resolve_gradient_reduction"]

GradientReduction = Literal["auto", "ordered", "allreduce"]
#: Values of ``gradient_reduction``.
GRADIENT_REDUCTIONS: tuple[str, ...] = ("auto", "ordered", "allreduce")


def resolve_gradient_reduction(gradient_reduction: str, comm_hook: Any, world_size: int) -> str:
    """``gradient_reduction`` with ``"auto"`` decided: ``"ordered"``, ``"allreduce"`` or ``"ddp_comm_hook"``."""
    if gradient_reduction != "auto":
        return gradient_reduction
    if comm_hook is not None:
        return "ddp_comm_hook"
    return "ordered" if world_size > 2 else "allreduce"


def install_gradient_reduction(
    model: DistributedDataParallel,
    module: pl.LightningModule | None,
    *,
    micro_batches_per_step: int,
    world_size: int,
    resolved: str,
) -> MicroBatchGradients | None:
    """Set up ``model``'s gradient averaging; returns the ``MicroBatchGradients`` when micro-batches are kept.

    ``resolved`` is the :func:`resolve_gradient_reduction` of the strategy's setting.
    """
    if micro_batches_per_step > 1 and module is not None and module.automatic_optimization:
        # world-size-invariant accumulation: the micro-batches are added in virtual-rank order by
        # MicroBatchGradients, so DDP's own all-reduce stays off (no_sync restores this flag)
        micro_gradients = MicroBatchGradients(list(module.parameters()), micro_batches_per_step, world_size)
        model.require_backward_grad_sync = False
        return micro_gradients
    if resolved == "ordered":
        model.register_comm_hook(None, ordered_mean_hook)
    return None
