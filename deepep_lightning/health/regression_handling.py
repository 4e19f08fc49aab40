"""What NaNRollbackCallback does about a collapse of a monitored metric: back to the best snapshot's weights.

A :class:`~deepep_lightning.health.regression.RegressionTrigger` watches a logged metric at each check
(averaged over ranks). When it collapses, the callback restores the weights and optimizer state of
the snapshot with the best value that every rank can load, applies the policy (``lower_lr`` scales
every learning rate) and starts a fresh snapshot ring there, since the older snapshots lead to the
collapse; past ``max_retries``, or with ``policy="stop"``, it stops with the best weights. It uses
the incident tools of :class:`~deepep_lightning.health.incidents._IncidentHandling` (events, the
policy's learning-rate scale, a clean stop).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from deepep_lightning.health.events import EventKind
from deepep_lightning.health.incidents import Outcome, _IncidentHandling, _public
from deepep_lightning.health.snapshot import Snapshot

__all__: list[str] = []


class _RegressionHandling(_IncidentHandling):
    """The regression half of :class:`~deepep_lightning.health.rollback.NaNRollbackCallback` (a mixin of it)."""

    def _monitored(self, trainer: pl.Trainer) -> float | None:
        """The monitored metric now, averaged over ranks (read at a check only: no per-step sync); None when absent."""
        assert self.regression is not None
        raw = trainer.callback_metrics.get(self.regression.monitor)
        if not trainer.strategy.reduce_boolean_decision(raw is not None, all=True):
            if not self._monitor_missing_warned:
                self._monitor_missing_warned = True
                rank_zero_warn(
                    f"NaNRollbackCallback: the monitored metric {self.regression.monitor!r} is not logged (yet); "
                    f"logged: {sorted(trainer.callback_metrics)}. HINT: `self.log({self.regression.monitor!r}, ...)`."
                )
            return None
        value = torch.as_tensor(raw).detach().float().reshape(()).to(trainer.strategy.root_device)
        return float(trainer.strategy.reduce(value, reduce_op="mean"))

    def _best_snapshot(self, trainer: pl.Trainer) -> Snapshot | None:
        """The snapshot with the best monitored value that every rank can load."""
        assert self.regression is not None
        for step in self.regression.rank(self._snapshot_metric):
            snapshot = self.ring.load(step)
            if trainer.strategy.reduce_boolean_decision(snapshot is not None, all=True):
                return snapshot
        return None

    def _handle_regression(self, trainer: pl.Trainer, pl_module: pl.LightningModule, value: float) -> None:
        """Restore the best snapshot's weights and apply the policy (or stop past the retry cap)."""
        assert self.regression is not None and self._health is not None
        trigger, step = self.regression, trainer.global_step
        why = trigger.describe(value)
        incident: dict[str, Any] = {"step": step, "reason": "regression", "detected_at": step, "attempts": 0}
        incident.update(monitor=trigger.monitor, value=value, best=trigger.best, best_step=trigger.best_step)
        self.incidents.append(incident)
        self._emit(trainer, EventKind.REGRESSION, step, details=why, **_public(incident))
        snapshot = self._best_snapshot(trainer)
        if snapshot is None or self.policy == "stop" or trigger.attempts >= self.max_retries:
            self._stop(trainer, pl_module, incident, why, weights_from=snapshot)
            return
        trigger.rolled_back()
        incident["attempts"] = trigger.attempts
        snapshot.restore_weights(trainer, pl_module)
        self._emit(trainer, EventKind.ROLLBACK, snapshot.step, to_step=snapshot.step, weights_only=True)
        if self.policy == "lower_lr":
            self._lr_scale *= self.lr_factor
        self._apply_lr_scale(trainer, snapshot.lr_scale)
        dropped = [snapshot.step, step]
        self._emit(trainer, EventKind.POLICY, step, policy=self.policy, lr_scale=self._lr_scale, dropped_steps=dropped)
        incident["outcome"] = Outcome.ROLLED_BACK.value  # RECOVERED once the metric holds (_regression_held)
        # the older snapshots lead to the collapse (a NaN replay from them would redo it): start afresh here
        best = self._snapshot_metric.get(snapshot.step, trigger.best)
        self.ring.clear()
        self._snapshot_metric = {}
        self._snapshot(trainer, pl_module, best)

    def _regression_held(self, trainer: pl.Trainer) -> None:
        """The metric held after a rollback: the collapse is over (``recovered``); a later one is a new incident."""
        incident = next(i for i in reversed(self.incidents) if i["reason"] == "regression")
        incident["outcome"] = Outcome.RECOVERED.value
        incident["recovered_at"] = trainer.global_step
        self._emit(trainer, EventKind.RECOVERED, incident["step"], **_public(incident))
