"""When DeepEPModule logs, and what it logs at the steps Lightning writes: the progress bar's host values and the
throughput."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch

__all__ = ["ProgressLog"]


class ProgressLog:
    """The progress bar's ``loss`` and ``return_100`` (read to the host once per write) and ``perf/env_steps_per_s``.

    The module logs its other scalars as device tensors (the loss terms at the steps :meth:`logs_step` names),
    which Lightning reads only when it writes; these two must be host numbers, so they are read at the steps
    Lightning writes and no other (a read makes the host wait for the step's device work).

    Args:
        env_steps_per_rollout: environment steps of one rollout (``num_envs × rollout_length``).
        log_throughput: also log environment steps per second since the previous write (wall-clock, so a
            figure two bitwise-identical runs do not share).

    Example::

        progress = ProgressLog(env_steps_per_rollout=32 * 32, log_throughput=True)
        if progress.writes_after(trainer, trainer.global_step):
            progress.log(module, loss, return_100, rollout_step)
    """

    def __init__(self, env_steps_per_rollout: int, log_throughput: bool) -> None:
        self.env_steps_per_rollout = env_steps_per_rollout
        self.log_throughput = log_throughput
        self.mark: tuple[float, int] | None = None  # (perf_counter, rollout step) at the last write

    @staticmethod
    def writes_after(trainer: pl.Trainer | None, step: int) -> bool:
        """Whether Lightning writes the logged values at the end of optimizer step ``step`` (0-based).

        Lightning writes when ``(batches_that_stepped + 1) % log_every_n_steps == 0``; with one optimizer
        step per batch that count is the ``global_step`` at the start of the step.
        """
        # log_every_n_steps is set by Lightning's logger connector, outside Trainer.__init__ (mypy misses it)
        every = trainer.log_every_n_steps if trainer is not None else 0  # type: ignore[attr-defined]
        return every > 0 and (step + 1) % every == 0

    @staticmethod
    def logs_step(trainer: pl.Trainer | None, step: int, batch_idx: int) -> bool:
        """Whether the module logs its loss terms in optimizer step ``step`` (0-based), batch ``batch_idx``.

        It does at the steps Lightning writes (:meth:`writes_after`), at each epoch's last batch (epoch-end
        callbacks such as ``ModelCheckpoint(monitor=...)`` read ``trainer.callback_metrics`` there) and at the
        fit's last step (``max_steps``); outside a Trainer always. Between those steps ``callback_metrics`` keeps
        the values of the last logged step. One ``self.log`` call costs Lightning's result bookkeeping on the host
        (a walk over the metric's record to move it to the value's device): about half a millisecond, so a
        handful of calls at every step costs about as much host time as a CUDA-graph replay of DeepEP's step.
        """
        if trainer is None or ProgressLog.writes_after(trainer, step):
            return True
        last_batch = batch_idx + 1 >= trainer.num_training_batches
        return last_batch or (trainer.max_steps > 0 and step + 1 >= trainer.max_steps)

    def start(self, rollout_step: int) -> None:
        """Start the throughput clock (at the fit's start)."""
        self.mark = (time.perf_counter(), rollout_step)

    def log(self, module: pl.LightningModule, loss: torch.Tensor, return_100: torch.Tensor, rollout_step: int) -> None:
        """Log the progress bar's values through ``module.log`` (one host read) and, if asked, the throughput."""
        host = torch.stack([loss.detach().float(), return_100.float()]).cpu()  # one read
        module.log("loss", host[0], on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=1)
        module.log("return_100", host[1], on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=1)
        if not self.log_throughput:
            return
        now = time.perf_counter()
        if self.mark is not None and rollout_step > self.mark[1]:
            start, first_step = self.mark
            rate = torch.tensor((rollout_step - first_step) * self.env_steps_per_rollout / max(now - start, 1e-9))
            module.log("perf/env_steps_per_s", rate, on_step=True, on_epoch=False, batch_size=1)
        self.mark = (now, rollout_step)
