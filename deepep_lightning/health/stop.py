"""How :class:`~deepep_lightning.NaNRollbackCallback` gives up: training stops, and never on non-finite weights.

A stop leaves the weights of the newest snapshot every rank can load (a collapse names its best
snapshot instead, weights and optimizer only), or the current ones when no snapshot loads and they are
finite on every rank; with neither it raises. The stop report says why, which weights were kept and
what the policy had done; it is logged as a health event and checkpointed with the callback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from deepep_lightning._sharded import local
from deepep_lightning.health._collectives import EmitEvent, newest_snapshot_on_every_rank
from deepep_lightning.health._replay import Replayer
from deepep_lightning.health.events import EventKind
from deepep_lightning.health.incident import Incident, Outcome
from deepep_lightning.health.policy import AppliedPolicy
from deepep_lightning.health.regression_handling import RegressionHandler
from deepep_lightning.health.snapshot import Snapshot, SnapshotRing

__all__: list[str] = []


@dataclass(eq=False)
class FiniteStop:
    """Stops training with finite weights and reports the stop.

    Args:
        replayer: restores the snapshot the stop keeps.
        ring: the snapshots to keep the weights of.
        applied_policy: what the policy had done (reported).
        regression: the monitored metric at each snapshot (reported for the kept one), or None.
        emit: records a health event.
        on_stopped: takes the stop report once training is stopped, before the stop is announced.

    Example::

        stop = FiniteStop(replayer, ring, applied_policy, None, emit, on_stopped=reports.append)
        stop(trainer, pl_module, incident, "the loss stays NaN")
    """

    replayer: Replayer
    ring: SnapshotRing
    applied_policy: AppliedPolicy
    regression: RegressionHandler | None
    emit: EmitEvent
    on_stopped: Callable[[dict[str, Any]], None]

    def __call__(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        incident: Incident,
        why: str,
        weights_from: Snapshot | None = None,
    ) -> None:
        """Stop with the weights of ``weights_from`` (weights and optimizer only), else of the newest snapshot
        every rank loads, else the current ones when they are finite on every rank.

        Raises:
            RuntimeError: no snapshot loads on every rank and the current weights are not finite.
        """
        stopped_at = max(trainer.global_step, incident.detected_at)
        snapshot = (
            weights_from if weights_from is not None else newest_snapshot_on_every_rank(trainer, self.ring, self.emit)
        )
        if weights_from is not None:
            weights_from.restore_weights(trainer, pl_module)
            weights = f"Weights restored to the snapshot of step {weights_from.step}"
        elif snapshot is not None:
            self.replayer.restore(trainer, pl_module, snapshot)
            weights = f"Weights restored to the snapshot of step {snapshot.step}"
        else:
            finite = all(bool(torch.isfinite(local(p.detach())).all()) for p in pl_module.parameters())
            if not trainer.strategy.reduce_boolean_decision(finite, all=True):
                self.emit(trainer, EventKind.STOPPED, incident.step, why=why, weights_at_step=None)
                raise RuntimeError(
                    f"NaNRollbackCallback cannot stop with finite weights: {why}, no snapshot loads on every rank "
                    "and the current weights are not finite. HINT: keep more snapshots (`keep_snapshots`) or "
                    "resume from an earlier checkpoint."
                )
            weights = f"No snapshot loads on every rank: the weights are the current (finite) ones of step {stopped_at}"
        trainer.should_stop = True
        incident.outcome = Outcome.STOPPED
        # the regression trigger's metric when the kept snapshot was taken
        metric = None
        if snapshot is not None and self.regression is not None and snapshot.step in self.regression.snapshot_metric:
            metric = {self.regression.trigger.monitor: self.regression.snapshot_metric[snapshot.step]}
        report = {
            "why": why,
            "weights_at_step": snapshot.step if snapshot is not None else stopped_at,
            "weights_metric": metric,
            "stopped_at_step": stopped_at,
            "policy": self.applied_policy.policy,
            "skipped_steps": sorted(self.applied_policy.skipped_steps),
            "lr_scale": self.applied_policy.lr_scale,
            **incident.event_fields(),
        }
        self.on_stopped(report)
        self.emit(trainer, EventKind.STOPPED, incident.step, announce=False, **report)
        rank_zero_warn(f"NaNRollbackCallback stopped training: {why}. {weights}; see the health event log.")
