"""Dropping the update of a skipped step while the step itself still runs on every rank.

A skipped step still returns its output (Lightning refuses ``None`` under DDP, and warns about it
alone) and runs its backward, so every DDP rank runs the same all-reduces. Under automatic
optimisation the module's ``optimizer_step`` hook runs the closure but not the optimizer. Under
manual optimisation (e.g. a step that is one CUDA graph) the update happens inside ``training_step``,
so the update state is kept before the step and put back, in place, after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from deepep_lightning._patches import patch_optimizer_step, unpatch_optimizer_step
from deepep_lightning.health._step_hooks import add_step_hook, remove_step_hook
from deepep_lightning.health.snapshot import clone_update_state, restore_update_state

__all__: list[str] = []

_HOOK_NAME = "rollback"


class StepSkip:
    """Drops the update of every optimizer step that ``skips`` names, on a module it is installed on.

    Args:
        skips: whether optimizer step ``step`` (``trainer.global_step`` when it starts) is skipped.

    Example::

        skip = StepSkip(lambda step: step in {7, 8})
        skip.install(trainer, pl_module)  # in setup; skip.remove(pl_module) in teardown
    """

    def __init__(self, skips: Callable[[int], bool]) -> None:
        self.skips = skips
        # the update state before a skipped manual-optimisation step, and what to put it back into
        self._undo: tuple[list[Any], pl.LightningModule, list[torch.optim.Optimizer]] | None = None

    def install(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Wrap the module's step innermost (after any planted fault) and its ``optimizer_step`` hook."""
        add_step_hook(
            pl_module,
            _HOOK_NAME,
            innermost=True,
            post=self._after_step,
            pre=lambda step, batch: self._before_step(trainer, pl_module, step, batch),
        )
        patch_optimizer_step(pl_module, lambda original: self._optimizer_step(trainer, original))

    def remove(self, pl_module: pl.LightningModule) -> None:
        """Undo :meth:`install`."""
        remove_step_hook(pl_module, _HOOK_NAME)
        unpatch_optimizer_step(pl_module)
        self._undo = None

    def _before_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, batch: Any) -> Any:
        # a manual step (a CUDA graph) updates inside training_step: keep what it will change, put it back after
        if self.skips(step) and not pl_module.automatic_optimization:
            self._undo = (clone_update_state(pl_module, trainer.optimizers), pl_module, trainer.optimizers)
        return batch

    def _after_step(self, step: int, output: Any) -> Any:
        if self._undo is not None and self.skips(step):
            saved, pl_module, optimizers = self._undo
            self._undo = None
            restore_update_state(pl_module, optimizers, saved)
        return output

    def _optimizer_step(self, trainer: pl.Trainer, original: Callable[..., None]) -> Callable[..., None]:
        """The ``optimizer_step`` hook: on a skipped step, run the closure (training step and backward) but not
        the optimizer, and drop the gradients.

        Lightning counts the step either way (its progress counters advance around the hook), so the
        data position and ``global_step`` move on as for a taken step. ``on_before_optimizer_step`` and
        gradient clipping run inside the optimizer's step and so are skipped with it.
        """

        def optimizer_step(epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            if not self.skips(trainer.global_step):
                original(epoch, batch_idx, optimizer, optimizer_closure)
                return
            if optimizer_closure is not None:
                optimizer_closure()
            optimizer.zero_grad(set_to_none=True)

        return optimizer_step
