"""What :class:`~deepep_lightning.NaNRollbackCallback` does about a failed check: roll back, replay, decide.

An incident restores a snapshot and replays the recorded steps through Lightning's own loop; a replay
that fails again is classified, diagnosed by the non-finite locator and answered by the policy (skip,
lower the learning rate, stop), one snapshot further back per retry, until a replay is clean or the
retries run out. The callback owns the lifecycle (hooks, batch recording, when to take a snapshot,
the checkpointed state) and hands each failed check to :class:`FailureRecovery`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from deepep_lightning._lightning_compat import optimizer_step_progress
from deepep_lightning.determinism.sharded_resume import gather_per_rank
from deepep_lightning.health._collectives import EmitEvent, distributed, newest_snapshot_on_every_rank
from deepep_lightning.health._replay import Replayer
from deepep_lightning.health.events import EventKind
from deepep_lightning.health.flags import HealthReason
from deepep_lightning.health.incident import Classification, Incident, Outcome
from deepep_lightning.health.policy import AppliedPolicy
from deepep_lightning.health.snapshot import Snapshot, SnapshotRing
from deepep_lightning.health.verdict import HealthVerdict

__all__: list[str] = []

#: Stop training with finite weights: ``stop(trainer, pl_module, incident, why, weights_from)``.
StopTraining = Callable[[pl.Trainer, pl.LightningModule, Incident, str, "Snapshot | None"], None]
#: Take a snapshot now: ``take_snapshot(trainer, pl_module, monitored_value)``.
TakeSnapshot = Callable[[pl.Trainer, pl.LightningModule, "float | None"], None]

# a diagnosis found on several ranks is reported from the earliest phase of the step
_PHASE_ORDER = {"before": 0, "forward": 1, "backward": 2, "optimizer": 3}


@dataclass(eq=False)
class FailureRecovery:
    """Roll back a failed check and replay until a replay is clean or the policy gives up.

    Args:
        replayer: restores snapshots and replays or diagnoses the recorded steps.
        ring: the snapshots to restart from.
        applied_policy: the policy, and what it has done so far (skipped steps, LR scale).
        max_retries: policy applications per incident before stopping.
        locate: run the non-finite locator on a reproducible failure.
        emit: records a health event.
        stop: stops training with finite weights (the callback's).
        take_snapshot: takes a snapshot after a clean replay (the callback's).

    Example::

        recovery = FailureRecovery(replayer, ring, applied_policy, 3, True, emit, stop, take_snapshot)
        recovery.handle(trainer, pl_module, verdict, Incident(verdict.bad_step, str(verdict.reason), step))
    """

    replayer: Replayer
    ring: SnapshotRing
    applied_policy: AppliedPolicy
    max_retries: int
    locate: bool
    emit: EmitEvent
    stop: StopTraining
    take_snapshot: TakeSnapshot

    def handle(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, verdict: HealthVerdict, incident: Incident
    ) -> None:
        """Answer ``verdict`` (a failed check), recording what happens in ``incident``.

        The step counters are rewound for the replays and put back after them, so ``trainer.global_step``
        never counts a replayed step twice; every step before the check's end counts as checked.
        """
        assert verdict.bad_step is not None  # every unhealthy verdict names its step
        end = trainer.global_step
        counters = optimizer_step_progress(trainer)
        saved_counters = [copy.deepcopy(counter.state_dict()) for counter in counters]
        self.emit(
            trainer,
            EventKind.DETECTED,
            verdict.bad_step,
            reason=verdict.reason,
            details=verdict.details,
            checked_at=end,
        )
        try:
            self._recover(trainer, pl_module, verdict, incident, end)
        finally:
            for counter, saved in zip(counters, saved_counters):
                counter.load_state_dict(saved)
            self.replayer.health.resume_checks_at(end)

    def _recover(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, failing: HealthVerdict, incident: Incident, end: int
    ) -> None:
        policy = self.applied_policy.policy
        restart_before: int | None = None
        while True:
            snapshot = self._pick_snapshot(trainer, failing, incident.attempts, restart_before)
            if snapshot is None:
                self.stop(trainer, pl_module, incident, "no healthy snapshot to roll back to", None)
                return
            if incident.attempts > 0:
                restart_before = snapshot.step
            self.emit(trainer, EventKind.ROLLBACK, snapshot.step, to_step=snapshot.step, replay_until=end)
            replayed = self.replayer.replay(trainer, pl_module, snapshot, end)
            if replayed.healthy:
                incident.outcome = Outcome.TRANSIENT if incident.attempts == 0 else Outcome.RECOVERED
                self.emit(trainer, EventKind(incident.outcome.value), incident.step, **incident.event_fields())
                self.take_snapshot(trainer, pl_module, None)
                return
            assert replayed.bad_step is not None  # an unhealthy replay names its step
            if incident.attempts == 0:
                incident.classification = self._classify(trainer, failing, replayed)
                if self.locate:
                    incident.diagnosed = True
                    incident.diagnosis = self._report_diagnosis(trainer, pl_module, snapshot, replayed.bad_step)
            if policy == "stop" or incident.attempts >= self.max_retries:
                self.stop(trainer, pl_module, incident, f"{replayed.reason} at step {replayed.bad_step} persists", None)
                return
            if policy == "skip" and self.applied_policy.skip_cap_reached(replayed.bad_step):
                why = (
                    f"{replayed.reason} at step {replayed.bad_step} persists and skipping it would skip more "
                    f"than max_skipped_steps={self.applied_policy.max_skipped_steps} steps in this run"
                )
                self.stop(trainer, pl_module, incident, why, None)
                return
            incident.attempts += 1
            fields = self.applied_policy.apply(replayed.bad_step)
            self.emit(trainer, EventKind.POLICY, replayed.bad_step, **fields)
            failing = replayed

    def _pick_snapshot(
        self, trainer: pl.Trainer, failing: HealthVerdict, attempts: int, restart_before: int | None
    ) -> Snapshot | None:
        """The snapshot to restart from: the latest one, and for a retry one strictly before the bad step.

        A changed replay must change the state *before* the bad step (its loss is a function of that
        state): each retry restarts strictly before it, one snapshot further back than the last retry.
        """
        snapshot = newest_snapshot_on_every_rank(trainer, self.ring, self.emit)
        if attempts == 0:
            return snapshot
        assert failing.bad_step is not None
        before = failing.bad_step if restart_before is None else min(restart_before, failing.bad_step)
        return newest_snapshot_on_every_rank(trainer, self.ring, self.emit, before_step=before) or snapshot

    def _classify(self, trainer: pl.Trainer, failing: HealthVerdict, replayed: HealthVerdict) -> Classification:
        """Reproducible when the replay fails at the same step for the same reason, or finds a non-finite
        parameter within the failed check's window (one label on all ranks)."""
        same = replayed.bad_step == failing.bad_step and replayed.reason == failing.reason
        # A parameter is read at a check only (the window's last step), a replay checks each step: it
        # finds a non-finite parameter at the step whose update made it, inside the check's window at
        # or before the step the check reported (the later symptom: a loss, a gradient, the window end).
        if replayed.reason == HealthReason.NONFINITE_PARAM and replayed.bad_step is not None:
            reported = failing.bad_step if failing.bad_step is not None else failing.end_step - 1
            same = same or failing.first_step <= replayed.bad_step <= reported
        same = bool(trainer.strategy.reduce_boolean_decision(same, all=True))
        label = Classification.REPRODUCIBLE if same else Classification.NONDETERMINISTIC
        assert replayed.bad_step is not None  # an unhealthy replay names its step
        self.emit(trainer, EventKind(label.value), replayed.bad_step, reason=replayed.reason)
        return label

    def _report_diagnosis(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, snapshot: Snapshot, bad_step: int
    ) -> dict[str, Any] | None:
        """Run the non-finite locator on the failing step, log and warn its report; returns it as a dict."""
        found = self.replayer.diagnose(trainer, pl_module, snapshot, bad_step)
        text = (
            found.describe()
            if found is not None
            else "no op of the step (forward, backward, optimizer step) produced a non-finite value when run again"
        )
        if distributed(trainer):
            # the origin names the op, for every rank: a non-finite value reaches the other ranks only through a
            # collective later in the step (a sharded module's all-gather or reduce-scatter, DDP's all-reduce),
            # so the earliest phase wins, then the lowest rank
            reports = gather_per_rank((found.to_dict(), text) if found is not None else None)
            found_at = [(_PHASE_ORDER.get(r[0]["phase"], 4), rank) for rank, r in enumerate(reports) if r is not None]
            first = min(found_at)[1] if found_at else None
            found_dict: dict[str, Any] | None = None
            if first is not None:
                text = f"on rank {first}: {reports[first][1]}"
                found_dict = {**reports[first][0], "rank": first}
        else:
            found_dict = found.to_dict() if found is not None else None
        self.emit(
            trainer,
            EventKind.DIAGNOSIS,
            bad_step,
            announce=False,  # warned below, with the whole report
            report=text,
            op=found_dict and found_dict["op"],
            module=found_dict and found_dict["module_path"],
            phase=found_dict and found_dict["phase"],
            optimizer=found_dict and found_dict["optimizer"],
            parameter=found_dict and found_dict["parameter"],
        )
        rank_zero_warn(f"NaNRollbackCallback diagnosis at step {bad_step}:\n{text}")
        return found_dict
