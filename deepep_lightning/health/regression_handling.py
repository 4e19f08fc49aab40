"""What NaNRollbackCallback does about a collapse of a monitored metric: back to the best snapshot's weights.

A :class:`~deepep_lightning.health.regression.RegressionTrigger` watches a logged metric at each check
(averaged over ranks). When it collapses, :class:`RegressionHandler` restores the weights and optimizer
state of the snapshot with the best value that every rank can load, applies the policy (``lower_lr``
scales every learning rate) and starts a fresh snapshot ring there, since the older snapshots lead to
the collapse; past ``max_retries``, or with ``policy="stop"``, it stops with the best weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from deepep_lightning.health._collectives import EmitEvent
from deepep_lightning.health.events import EventKind
from deepep_lightning.health.incident import Incident, Outcome
from deepep_lightning.health.policy import AppliedPolicy
from deepep_lightning.health.recovery import StopTraining, TakeSnapshot
from deepep_lightning.health.regression import RegressionTrigger
from deepep_lightning.health.snapshot import Snapshot, SnapshotRing

__all__: list[str] = []


@dataclass(eq=False)
class RegressionHandler:
    """The monitored metric at each snapshot, and the rollback of a collapse to the best of them.

    Args:
        trigger: decides when the metric has collapsed or held.
        applied_policy: the policy, and the LR scale it has reached.
        max_retries: rollbacks per collapse before stopping.
        emit: records a health event.
        take_snapshot: takes a snapshot at the restored weights (the callback's).

    Example::

        handler = RegressionHandler(RegressionTrigger("train/return"), applied_policy, 3, emit, take_snapshot)
        value = handler.monitored(trainer)
    """

    trigger: RegressionTrigger
    applied_policy: AppliedPolicy
    max_retries: int
    emit: EmitEvent
    take_snapshot: TakeSnapshot
    snapshot_metric: dict[int, float] = field(default_factory=dict, init=False)  # snapshot step -> the value there
    _monitor_missing_warned: bool = field(default=False, init=False)

    def monitored(self, trainer: pl.Trainer) -> float | None:
        """The monitored metric now, averaged over ranks (read at a check only: no per-step sync); None when absent."""
        raw = trainer.callback_metrics.get(self.trigger.monitor)
        if not trainer.strategy.reduce_boolean_decision(raw is not None, all=True):
            if not self._monitor_missing_warned:
                self._monitor_missing_warned = True
                rank_zero_warn(
                    f"NaNRollbackCallback: the monitored metric {self.trigger.monitor!r} is not logged (yet); "
                    f"logged: {sorted(trainer.callback_metrics)}. HINT: `self.log({self.trigger.monitor!r}, ...)`."
                )
            return None
        value = torch.as_tensor(raw).detach().float().reshape(()).to(trainer.strategy.root_device)
        return float(trainer.strategy.reduce(value, reduce_op="mean"))

    def note_snapshot(self, step: int, metric: float | None, kept_steps: list[int]) -> int | None:
        """Record the metric at the snapshot of ``step``, forget snapshots no longer kept; returns the best step."""
        if metric is not None:
            self.snapshot_metric[step] = metric
        kept = set(kept_steps)
        self.snapshot_metric = {at: value for at, value in self.snapshot_metric.items() if at in kept}
        ranked = self.trigger.rank(self.snapshot_metric)
        return ranked[0] if ranked else None

    def _best_snapshot(self, trainer: pl.Trainer, ring: SnapshotRing) -> Snapshot | None:
        """The snapshot with the best monitored value that every rank can load."""
        for step in self.trigger.rank(self.snapshot_metric):
            snapshot = ring.load(step)
            if trainer.strategy.reduce_boolean_decision(snapshot is not None, all=True):
                return snapshot
        return None

    def open_incident(self, step: int, value: float) -> Incident:
        """The incident of a collapse to ``value`` detected at ``step``."""
        trigger = self.trigger
        return Incident(
            step=step,
            reason="regression",
            detected_at=step,
            monitor=trigger.monitor,
            value=value,
            best=trigger.best,
            best_step=trigger.best_step,
        )

    def handle(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        incident: Incident,
        ring: SnapshotRing,
        stop: StopTraining,
    ) -> None:
        """Restore the best snapshot's weights of ``ring`` and apply the policy (or ``stop`` past the retry cap)."""
        trigger, step = self.trigger, trainer.global_step
        assert incident.value is not None  # a collapse has a value
        why = trigger.describe(incident.value)
        self.emit(trainer, EventKind.REGRESSION, step, details=why, **incident.event_fields())
        snapshot = self._best_snapshot(trainer, ring)
        if snapshot is None or self.applied_policy.policy == "stop" or trigger.attempts >= self.max_retries:
            stop(trainer, pl_module, incident, why, snapshot)
            return
        trigger.rolled_back()
        incident.attempts = trigger.attempts
        snapshot.restore_weights(trainer, pl_module)
        self.emit(trainer, EventKind.ROLLBACK, snapshot.step, to_step=snapshot.step, weights_only=True)
        if self.applied_policy.policy == "lower_lr":
            self.applied_policy.lower_lr()
        self.applied_policy.scale_learning_rates(trainer, snapshot.lr_scale)
        dropped = [snapshot.step, step]
        self.emit(
            trainer,
            EventKind.POLICY,
            step,
            policy=self.applied_policy.policy,
            lr_scale=self.applied_policy.lr_scale,
            dropped_steps=dropped,
        )
        incident.outcome = Outcome.ROLLED_BACK  # RECOVERED once the metric holds (held)
        # the older snapshots lead to the collapse (a NaN replay from them would redo it): start afresh here
        best = self.snapshot_metric.get(snapshot.step, trigger.best)
        ring.clear()
        self.snapshot_metric = {}
        self.take_snapshot(trainer, pl_module, best)

    def held(self, trainer: pl.Trainer, incident: Incident) -> None:
        """The metric held after the rollback of ``incident``: the collapse is over (``recovered``)."""
        incident.outcome = Outcome.RECOVERED
        incident.recovered_at = trainer.global_step
        self.emit(trainer, EventKind.RECOVERED, incident.step, **incident.event_fields())
