"""Stepwise linear decay of DeepEPModule's learning rates (``lr_decay_steps``, ``lr_decay_stages``).

Once a policy has solved its task, full-size updates keep moving it, and a 100-episode mean that reached
the threshold dips below it again; shrinking the steps as the budget runs out keeps it there (PPO's
learning-rate annealing). Here every learning rate falls in ``stages`` equal stairs from its value to
``1/stages`` of it over ``decay_steps`` training steps, and stays at the last stair after them:

    lr(step) = initial_lr * (1 - min(step * stages // decay_steps, stages - 1) / stages)

Stairs rather than a line: the CUDA-graph step bakes the learning rates into the graph, so each change
re-captures it (``stages`` captures in a run, not one per step). The rate is a function of the training
step alone, so a resumed run, a rolled-back and replayed step and a run of another world size all see the
same one. Each param group keeps its undecayed rate in ``initial_lr`` (the key PyTorch's schedulers use,
saved with the optimizer's state): ``NaNRollbackCallback``'s ``lower_lr`` scales it with ``lr``, and the
decay applies on top.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

if TYPE_CHECKING:
    from deepep_lightning.deepep.module import DeepEPModule

__all__ = ["apply_lr_decay", "decay_module_lrs", "lr_decay_factor"]


def lr_decay_factor(step: int, decay_steps: int, stages: int) -> float:
    """The multiplier of the learning rates at training step ``step`` (0-based): ``1, 1 - 1/stages, ...``.

    Example::

        >>> [lr_decay_factor(step, 8, 4) for step in range(10)]
        [1.0, 1.0, 0.75, 0.75, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25]
    """
    return 1.0 - min(step * stages // decay_steps, stages - 1) / stages


def apply_lr_decay(optimizer: torch.optim.Optimizer, step: int, decay_steps: int, stages: int) -> None:
    """Set every group's ``lr`` to its ``initial_lr`` (recorded at the first call) times :func:`lr_decay_factor`."""
    factor = lr_decay_factor(step, decay_steps, stages)
    for group in optimizer.param_groups:
        initial = group.setdefault("initial_lr", group["lr"])
        group["lr"] = initial * factor


def decay_module_lrs(module: DeepEPModule, step: int, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Apply ``module``'s decay (if it has one) for training step ``step`` to ``optimizer`` (default: the
    optimizer of the module's trainer)."""
    decay_steps = module.hparams.lr_decay_steps
    if decay_steps is None:
        return
    if optimizer is None:
        optimizer = cast(LightningOptimizer, module.optimizers()).optimizer  # the module has one optimizer
    apply_lr_decay(optimizer, step, decay_steps, module.hparams.lr_decay_stages)
