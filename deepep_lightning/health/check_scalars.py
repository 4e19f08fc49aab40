"""Scalars measured at a health check, logged without a host sync and without repeated points.

A check reads its values to the host once; logging them the usual way would cost more: Lightning
moves a Python float to the module's device and converts every progress-bar value back with
``.item()`` at each step's end (a host sync per step on a GPU), and writes a value logged at one
step again at every later write until the epoch ends. :func:`log_check_scalars` avoids both;
:func:`log_epoch_scalar` logs a value read once per epoch the same way.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

__all__ = ["log_check_scalars", "log_epoch_scalar"]


def log_check_scalars(
    trainer: pl.Trainer, pl_module: pl.LightningModule, metrics: dict[str, float], prog_bar: tuple[str, ...] = ()
) -> None:
    """Log host values measured at a check: to Lightning's metrics, and to the loggers at this step only.

    ``pl_module.log`` (``logger=False``) puts them in ``trainer.callback_metrics`` (what ``EarlyStopping``
    and ``ModelCheckpoint`` monitor) and the progress bar, as CPU tensors: Lightning moves a Python
    float to the module's device and converts every progress-bar value back with ``.item()`` at each
    step's end, a host sync per step on a GPU; a CPU tensor needs neither. The loggers get them on
    rank 0 at the step Lightning writes this step's training scalars (``global_step - 1`` in
    ``on_train_batch_end``), once: Lightning would write a value logged at a check again at every later
    write until the epoch ends, points that were never measured (and that a resumed run, whose
    logging starts afresh, does not repeat).
    """
    for name, value in metrics.items():
        pl_module.log(
            name,
            torch.tensor(float(value)),
            on_step=True,
            on_epoch=False,
            prog_bar=name in prog_bar,
            logger=False,
            batch_size=1,
        )
    if metrics and trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(dict(metrics), step=max(trainer.global_step - 1, 0))


def log_epoch_scalar(trainer: pl.Trainer, pl_module: pl.LightningModule, name: str, value: float) -> None:
    """Log a host value read at an epoch end: to Lightning's epoch metrics, and to the loggers once (rank 0)."""
    pl_module.log(name, torch.tensor(value), on_epoch=True, logger=False, batch_size=1)
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics({name: value}, step=max(trainer.global_step - 1, 0))
