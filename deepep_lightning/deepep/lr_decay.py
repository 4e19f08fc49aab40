"""Stepwise linear decay of DeepEP's learning rates (``lr_decay_steps``, ``lr_decay_stages``).

Once a policy has solved its task, full-size updates keep moving it, and a 100-episode mean that reached
the threshold dips below it again; shrinking the steps as the budget runs out keeps it there (PPO's
learning-rate annealing). Here every learning rate falls in ``stages`` equal stairs from its value to
``1/stages`` of it over ``decay_steps`` training steps, and stays at the last stair after them:

    lr(step) = initial_lr * (1 - min(step * stages // decay_steps, stages - 1) / stages)

Stairs rather than a line: the CUDA-graph step bakes the learning rates into the graph, so each change
re-captures it (``stages`` captures in a run, not one per step). :func:`lr_stairs` is a
:class:`~torch.optim.lr_scheduler.LambdaLR` stepped once per optimizer step, so a resumed run (its state is in
the checkpoint), a rolled-back and replayed step (snapshots carry it) and a run of another world size all see
the same rate. ``NaNRollbackCallback``'s ``lower_lr`` scales its ``base_lrs`` with ``lr``, and the decay
applies on top.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["lr_decay_factor", "lr_stairs"]


def lr_decay_factor(step: int, decay_steps: int, stages: int) -> float:
    """The multiplier of the learning rates at training step ``step`` (0-based): ``1, 1 - 1/stages, ...``.

    Example::

        >>> [lr_decay_factor(step, 8, 4) for step in range(10)]
        [1.0, 1.0, 0.75, 0.75, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25]
    """
    return 1.0 - min(step * stages // decay_steps, stages - 1) / stages


def lr_stairs(optimizer: torch.optim.Optimizer, decay_steps: int, stages: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler that sets every group's ``lr`` to its ``initial_lr`` times :func:`lr_decay_factor` of the step.

    Step it once after every optimizer step (Lightning's ``"interval": "step"``).

    Example::

        scheduler = lr_stairs(optimizer, decay_steps=8, stages=4)
    """
    factor = functools.partial(lr_decay_factor, decay_steps=decay_steps, stages=stages)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
