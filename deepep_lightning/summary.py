"""RunSummaryCallback: one line at the end of ``fit``: where the logs are, the final metrics, the health events."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from deepep_lightning import _checks
from deepep_lightning.health.events import INCIDENT_KINDS, EventKind, run_log_dir
from deepep_lightning.health.health_callback import NumericalHealthCallback
from deepep_lightning.health.rollback import NaNRollbackCallback

__all__ = ["RunSummaryCallback"]

log = logging.getLogger(__name__)


class RunSummaryCallback(Callback):
    """Prints one summary line on rank 0 when ``fit`` ends (or fails), through Lightning's ``rank_zero_info``.

    The line names the run's log directory with the ``tensorboard --logdir`` command that shows it,
    the final value of each metric in ``metrics`` (read from ``trainer.callback_metrics``; ``n/a``
    when the module does not log it), where a :class:`~deepep_lightning.NaNRollbackCallback` that stopped
    the run left the weights (the metrics were logged before the stop; the weights are a snapshot's, with
    its value of the regression trigger's metric), and the health events of every
    :class:`~deepep_lightning.NumericalHealthCallback` in the trainer: incidents detected, rollbacks,
    transient faults, recoveries and stops. For example::

        deepep_lightning: fit ended at step 1000 | logs: runs/cartpole/version_0 (tensorboard --logdir
        runs/cartpole/version_0) | train/episode_return_100=487.2 | health: 1 detected, 1 rolled back,
        1 transient, 0 recovered, 0 stopped

    and after a stop at the retry cap of a regression rollback::

        deepep_lightning: fit ended at step 1640 | logs: ... | train/episode_return_100=142.5 | stopped at step
        1640 with the weights of step 1150 (train/episode_return_100=487.3 there) | health: 6 detected, ...

    It is printed on the ``lightning.pytorch`` logger, which Lightning shows by default; the summary
    is also kept in :attr:`last_summary`. Reading the metrics is one host read at the end of the run.

    Args:
        metrics: names of logged metrics to report (e.g. DeepEP's ``"train/episode_return_100"``).

    Raises:
        MisconfigurationException: ``metrics`` is not a sequence of non-empty strings.

    Example::

        trainer = Trainer(callbacks=[NumericalHealthCallback(), RunSummaryCallback(["val/acc"])])
    """

    def __init__(self, metrics: Sequence[str] = ()) -> None:
        self.metrics = list(_checks.str_sequence("RunSummaryCallback", "metrics", metrics))
        for name in self.metrics:
            _checks.non_empty_str("RunSummaryCallback", "metrics", name)
        self.last_summary: str | None = None

    def summary(self, trainer: pl.Trainer, ended_by: BaseException | None = None) -> str:
        """The summary line for ``trainer`` as it stands now."""
        parts = [f"deepep_lightning: fit {'ended' if ended_by is None else 'failed'} at step {trainer.global_step}"]
        if ended_by is not None:
            parts[0] += f" ({type(ended_by).__name__}: {ended_by})"
        if trainer.loggers:
            directory = run_log_dir(trainer)
            parts.append(f"logs: {directory} (tensorboard --logdir {directory})")
        else:
            parts.append("logs: none (no logger)")
        for name in self.metrics:
            parts.append(f"{name}={_format_metric(trainer.callback_metrics.get(name))}")
        parts.extend(_stop_summaries(trainer))
        parts.append(_health_summary(trainer))
        return " | ".join(parts)

    def _print(self, trainer: pl.Trainer, ended_by: BaseException | None = None) -> None:
        self.last_summary = self.summary(trainer, ended_by)
        rank_zero_info(self.last_summary)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._print(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._print(trainer, exception)


def _format_metric(value: Any) -> str:
    if value is None:
        return "n/a"
    number = float(value.item() if isinstance(value, torch.Tensor) else value)
    return f"{number:.4g}" if math.isfinite(number) else repr(number)


def _stop_summaries(trainer: pl.Trainer) -> list[str]:
    """Where each rollback callback that stopped the run left the weights: the metrics above were logged
    before the stop, the weights are the restored snapshot's (with its monitored value when there is one)."""
    parts = []
    rollbacks = [c for c in trainer.callbacks if isinstance(c, NaNRollbackCallback)]  # type: ignore[attr-defined]
    for report in (rollback.stop_report for rollback in rollbacks if rollback.stop_report):
        stopped, weights = report.get("stopped_at_step"), report.get("weights_at_step")
        part = f"stopped at step {stopped} with the weights of step {weights}"
        metric = report.get("weights_metric")
        if metric:
            name, value = next(iter(metric.items()))
            part += f" ({name}={_format_metric(value)} there)"
        parts.append(part)
    return parts


def _health_summary(trainer: pl.Trainer) -> str:
    checkers = [c for c in trainer.callbacks if isinstance(c, NumericalHealthCallback)]  # type: ignore[attr-defined]
    if not checkers:
        return "health: not checked (no NumericalHealthCallback)"

    def count(*kinds: str) -> int:
        return sum(checker.events.count(*kinds) for checker in checkers)

    return (
        f"health: {count(*INCIDENT_KINDS)} detected, {count(EventKind.ROLLBACK.value)} rolled back, "
        f"{count(EventKind.TRANSIENT.value)} transient, {count(EventKind.RECOVERED.value)} recovered, "
        f"{count(EventKind.STOPPED.value)} stopped"
    )
