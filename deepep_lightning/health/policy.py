"""What :class:`~deepep_lightning.NaNRollbackCallback`'s policy has done to a run: skipped steps and the LR scale.

A reproducible failure is answered by the policy: ``"skip"`` drops the updates of some steps,
``"lower_lr"`` multiplies every learning rate by a factor, ``"stop"`` ends the run.
:class:`AppliedPolicy` keeps the first two across rollbacks and restarts (both are checkpointed): a
restored snapshot carries the LR scale it was taken at, so the current scale is applied over it.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import lightning.pytorch as pl

__all__ = ["POLICIES", "AppliedPolicy", "Policy"]

#: What a reproducible failure gets: skip its batches, lower every learning rate, or stop.
Policy = Literal["skip", "lower_lr", "stop"]
POLICIES: tuple[str, ...] = get_args(Policy)


class AppliedPolicy:
    """The steps whose updates are skipped and the factor every learning rate is scaled by, so far.

    Args:
        policy: ``"skip"``, ``"lower_lr"`` or ``"stop"`` (validated by the callback).
        skip_batches: steps skipped from the bad one under ``"skip"``.
        lr_factor: the LR multiplier of one ``"lower_lr"`` application.
        max_skipped_steps: the most steps ``"skip"`` may skip over the whole run.

    Example::

        applied = AppliedPolicy("skip", skip_batches=2, lr_factor=0.5, max_skipped_steps=100)
        applied.apply(7)  # {"policy": "skip", "skipped_steps": [7, 8]}
        assert applied.skips(8) and not applied.skips(9)
    """

    def __init__(self, policy: Policy, skip_batches: int, lr_factor: float, max_skipped_steps: int) -> None:
        self.policy: Policy = policy
        self.skip_batches = skip_batches
        self.lr_factor = lr_factor
        self.max_skipped_steps = max_skipped_steps
        self.skipped_steps: set[int] = set()
        self.lr_scale = 1.0  # the product of every lower_lr application (1.0: the LRs as configured)

    def skips(self, step: int) -> bool:
        """Whether the update of optimizer step ``step`` is dropped."""
        return step in self.skipped_steps

    def _skipped_from(self, bad_step: int) -> list[int]:
        return list(range(bad_step, bad_step + self.skip_batches))

    def skip_cap_reached(self, bad_step: int) -> bool:
        """Whether skipping from ``bad_step`` would skip more than ``max_skipped_steps`` steps in the run."""
        return len(self.skipped_steps | set(self._skipped_from(bad_step))) > self.max_skipped_steps

    def apply(self, bad_step: int) -> dict[str, Any]:
        """Apply the policy to a failure at ``bad_step`` (``"skip"`` or ``"lower_lr"``); returns the event fields."""
        if self.policy == "skip":
            skipped = self._skipped_from(bad_step)
            self.skipped_steps.update(skipped)
            return {"policy": "skip", "skipped_steps": skipped}
        self.lower_lr()
        return {"policy": "lower_lr", "lr_scale": self.lr_scale}

    def lower_lr(self) -> None:
        """Scale every learning rate by ``lr_factor`` (from the next :meth:`scale_learning_rates` on)."""
        self.lr_scale *= self.lr_factor

    def scale_learning_rates(self, trainer: pl.Trainer, restored_scale: float) -> None:
        """Bring the learning rates of restored state, taken at ``restored_scale``, to the current scale.

        Every optimizer's ``lr`` (and ``initial_lr``, which schedulers restart from) and every
        scheduler's ``base_lrs`` are multiplied by the ratio of the two scales.
        """
        ratio = self.lr_scale / restored_scale
        if ratio == 1.0:
            return
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * ratio
                if "initial_lr" in group:
                    group["initial_lr"] = group["initial_lr"] * ratio
        for config in trainer.lr_scheduler_configs:
            if hasattr(config.scheduler, "base_lrs"):
                config.scheduler.base_lrs = [lr * ratio for lr in config.scheduler.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {"skip_steps": sorted(self.skipped_steps), "lr_scale": self.lr_scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = set(state_dict.get("skip_steps", []))
        self.lr_scale = float(state_dict.get("lr_scale", 1.0))
