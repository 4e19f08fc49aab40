"""Re-running recorded training steps through Lightning's own optimization loop.

A replay calls the very objects the fit loop calls (``automatic_optimization.run``
or ``manual_optimization.run``), so closure, backward, precision plugin,
gradient clipping, ``optimizer_step`` and every callback hook run exactly as in
the original step: with the same state, batch and RNG, the same bits come out.
Logging is silenced during a replay (the step was already logged), and
LR schedulers with ``interval="step"`` are stepped as the epoch loop does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from deepep_lightning._lightning_compat import run_optimization_step
from deepep_lightning.protocols import ReplayAware

__all__: list[str] = []


def clone_batch(batch: Any) -> Any:
    """A private copy of ``batch`` (a training step may modify its batch in place)."""
    return apply_to_collection(batch, Tensor, lambda t: t.detach().clone())


@dataclass
class ReplayEntry:
    """A step as the loop ran it: its index, its batch (a private copy) and its ``batch_idx``."""

    step: int
    batch: Any
    batch_idx: int
    epoch: int
    is_last_batch: bool = False  # the epoch loop also stepped interval="epoch" schedulers after it


def call_replay_hooks(trainer: pl.Trainer, pl_module: pl.LightningModule, entry: ReplayEntry) -> None:
    """Call every :class:`~deepep_lightning.protocols.ReplayAware` callback before a step is run again.

    Callbacks that set per-step state in on_train_batch_start (DeterminismCallback reseeds the global
    RNG there) get the same chance before a replayed step (a replay or a diagnosis); other
    on_train_batch_start work (batch copies, fault injection) must not run twice, so this is an
    opt-in hook, not that one.
    """
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # set by Lightning's callback connector
        if isinstance(callback, ReplayAware):
            callback.on_replay_batch_start(trainer, pl_module, entry.batch, entry.batch_idx, entry.epoch)


def run_step(trainer: pl.Trainer, pl_module: pl.LightningModule, entry: ReplayEntry) -> Any:
    """Run one recorded step (forward, backward, optimizer step, step-interval LR schedulers).

    With manual optimisation (e.g. a step that is one CUDA graph) this calls ``training_step``,
    which runs the whole step itself.
    """
    if trainer.global_step != entry.step:
        raise RuntimeError(f"replay out of order: trainer is at step {trainer.global_step}, entry is step {entry.step}")
    call_replay_hooks(trainer, pl_module, entry)
    batch = clone_batch(entry.batch)
    if pl_module.automatic_optimization:
        outputs = run_optimization_step(trainer, batch, entry.batch_idx, trainer.optimizers[0])
        for config in trainer.lr_scheduler_configs:
            if (
                not config.reduce_on_plateau
                and config.interval == "step"
                and (entry.batch_idx + 1) % config.frequency == 0
            ):
                pl_module.lr_scheduler_step(config.scheduler, None)
            elif (
                not config.reduce_on_plateau
                and config.interval == "epoch"
                and entry.is_last_batch
                and (entry.epoch + 1) % config.frequency == 0
            ):
                pl_module.lr_scheduler_step(config.scheduler, None)
    else:
        outputs = run_optimization_step(trainer, batch, entry.batch_idx, None)
    return outputs
