"""What NaNRollbackCallback does about an incident: a failed check of the numerical health.

An incident restores a snapshot and replays the recorded steps through Lightning's own loop; a replay
that fails again is classified, diagnosed by the non-finite locator and answered by the policy (skip,
lower the learning rate, stop), one snapshot further back per retry, until a replay is clean or the
retries run out. The callback (:mod:`deepep_lightning.health.rollback`) owns the lifecycle: hooks,
batch recording, when to take a snapshot, and the checkpointed state; it inherits these decisions
from :class:`_IncidentHandling`, whose annotations name the configuration and state they read, through
:class:`~deepep_lightning.health.regression_handling._RegressionHandling`, which answers a collapse of
a monitored metric with the same tools.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from deepep_lightning._enums import StrEnum
from deepep_lightning._lightning_compat import optimizer_step_progress
from deepep_lightning._patches import silenced_logging
from deepep_lightning._sharded import local
from deepep_lightning.audit.nonfinite import NonFiniteOp, locate_nonfinite, locate_nonfinite_update
from deepep_lightning.determinism.sharded_resume import gather_per_rank
from deepep_lightning.health._collectives import distributed, min_max_over_ranks
from deepep_lightning.health._replay import ReplayEntry, call_replay_hooks, clone_batch, run_step
from deepep_lightning.health.events import EventKind
from deepep_lightning.health.flags import HealthReason
from deepep_lightning.health.health_callback import NumericalHealthCallback
from deepep_lightning.health.regression import RegressionTrigger
from deepep_lightning.health.snapshot import Snapshot, SnapshotRing
from deepep_lightning.health.verdict import HealthVerdict
from deepep_lightning.protocols import RolloutStateful, UncapturedSteps

__all__ = ["Classification", "Outcome", "Policy"]

#: What a reproducible failure gets: skip its batches, lower every learning rate, or stop.
Policy = Literal["skip", "lower_lr", "stop"]
_POLICIES: tuple[str, ...] = get_args(Policy)


class Classification(StrEnum):
    """What the first replay of a failed step showed."""

    REPRODUCIBLE = "reproducible"  # the same failure at the same step: a numerical bug
    NONDETERMINISTIC = "nondeterministic"  # a failure, but another one: the step is not reproducible


class Outcome(StrEnum):
    """How an incident ended."""

    TRANSIENT = "transient"  # the first replay was clean
    RECOVERED = "recovered"  # a replay after the policy was clean; a regression's rollback that held
    ROLLED_BACK = "rolled_back"  # a regression rolled back, the metric not yet seen to hold
    STOPPED = "stopped"  # gave up: weights at the last healthy snapshot, training stopped


class _IncidentHandling:
    """The incident half of :class:`~deepep_lightning.health.rollback.NaNRollbackCallback` (a mixin of it)."""

    # configuration, validated by the callback's constructor
    policy: Policy
    skip_batches: int
    lr_factor: float
    max_retries: int
    max_skipped_steps: int
    locate: bool
    rollback_on_spike: bool
    regression: RegressionTrigger | None
    # state the callback creates and checkpoints; an incident reads and updates it
    ring: SnapshotRing
    incidents: list[dict[str, Any]]
    stopped: bool
    stop_report: dict[str, Any] | None
    _health: NumericalHealthCallback | None
    _buffer: list[ReplayEntry]
    _skip_steps: set[int]
    _lr_scale: float
    _snapshot_metric: dict[int, float]
    _monitor_missing_warned: bool
    # the frames a diagnosis runs through on its way to the step: never reported as the user's code
    _plumbing_files: tuple[str, ...]

    def _snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule, metric: float | None = None) -> None:
        """Take a snapshot now (the callback's, which also decides when to take one)."""
        raise NotImplementedError

    def _emit(
        self, trainer: pl.Trainer, kind: EventKind, step: int, announce: bool = True, **fields: Any
    ) -> dict[str, Any]:
        assert self._health is not None
        return self._health.events.emit(trainer, kind, step, announce=announce, **fields)

    def _latest_snapshot(self, trainer: pl.Trainer, before_step: int | None = None) -> Snapshot | None:
        """The newest snapshot that **every** rank can load (with ``step < before_step`` when given), or None.

        Each rank proposes the newest one it can load; while the proposals differ, every rank looks
        again at or below the smallest (a corrupt file on one rank makes all fall back together, so
        the replays keep the same length and the collectives stay matched). None on all ranks when
        one rank has none.
        """

        def on_corrupt(path: str, error: Exception) -> None:
            self._emit(trainer, EventKind.CORRUPT_SNAPSHOT, trainer.global_step, path=path, error=str(error))
            warnings.warn(f"NaNRollbackCallback: {error}; falling back to the previous snapshot.", stacklevel=2)

        limit = before_step
        while True:
            snapshot = self.ring.latest(on_corrupt, limit)
            low, high = min_max_over_ranks(trainer, snapshot.step if snapshot is not None else -1)
            if low == high:
                return snapshot
            if low < 0:
                return None
            limit = low + 1

    # ---------------------------------------------------------------- failed checks
    def _handle_failure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, verdict: HealthVerdict) -> None:
        """Roll back and replay until a replay is clean or the policy gives up (see NaNRollbackCallback)."""
        assert self._health is not None
        assert verdict.bad_step is not None  # every unhealthy verdict names its step
        end = trainer.global_step
        counters = optimizer_step_progress(trainer)
        saved_counters = [copy.deepcopy(counter.state_dict()) for counter in counters]
        # plain values only: incidents are checkpointed (state_dict) and loaded with weights_only
        incident: dict[str, Any] = {"step": verdict.bad_step, "reason": str(verdict.reason), "detected_at": end}
        incident["attempts"] = 0
        self.incidents.append(incident)
        self._emit(
            trainer,
            EventKind.DETECTED,
            verdict.bad_step,
            reason=verdict.reason,
            details=verdict.details,
            checked_at=end,
        )
        failing = verdict
        restart_before: int | None = None
        try:
            while True:
                snapshot = self._pick_snapshot(trainer, failing, incident["attempts"], restart_before)
                if snapshot is None:
                    self._stop(trainer, pl_module, incident, "no healthy snapshot to roll back to")
                    return
                if incident["attempts"] > 0:
                    restart_before = snapshot.step
                self._emit(trainer, EventKind.ROLLBACK, snapshot.step, to_step=snapshot.step, replay_until=end)
                replayed = self._replay(trainer, pl_module, snapshot, end)
                if replayed.healthy:
                    outcome = Outcome.TRANSIENT if incident["attempts"] == 0 else Outcome.RECOVERED
                    incident["outcome"] = outcome.value
                    self._emit(trainer, EventKind(outcome.value), incident["step"], **_public(incident))
                    self._snapshot(trainer, pl_module)
                    return
                if incident["attempts"] == 0:
                    incident["classification"] = self._classify(trainer, failing, replayed).value
                    if self.locate:
                        incident["diagnosis"] = self._report_diagnosis(trainer, pl_module, snapshot, replayed)
                if self.policy == "stop" or incident["attempts"] >= self.max_retries:
                    self._stop(trainer, pl_module, incident, f"{replayed.reason} at step {replayed.bad_step} persists")
                    return
                if self.policy == "skip" and self._skip_cap_reached(replayed):
                    why = (
                        f"{replayed.reason} at step {replayed.bad_step} persists and skipping it would skip more "
                        f"than max_skipped_steps={self.max_skipped_steps} steps in this run"
                    )
                    self._stop(trainer, pl_module, incident, why)
                    return
                incident["attempts"] += 1
                self._apply_policy(trainer, replayed)
                failing = replayed
        finally:
            for counter, saved in zip(counters, saved_counters):
                counter.load_state_dict(saved)
            self._health.resume_checks_at(end)

    def _pick_snapshot(
        self, trainer: pl.Trainer, failing: HealthVerdict, attempts: int, restart_before: int | None
    ) -> Snapshot | None:
        """The snapshot to restart from: the latest one, and for a retry one strictly before the bad step.

        A changed replay must change the state *before* the bad step (its loss is a function of that
        state): each retry restarts strictly before it, one snapshot further back than the last retry.
        """
        snapshot = self._latest_snapshot(trainer)
        if attempts == 0:
            return snapshot
        assert failing.bad_step is not None
        before = failing.bad_step if restart_before is None else min(restart_before, failing.bad_step)
        return self._latest_snapshot(trainer, before_step=before) or snapshot

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
        self._emit(trainer, EventKind(label.value), replayed.bad_step, reason=replayed.reason)
        return label

    def _report_diagnosis(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, snapshot: Snapshot, replayed: HealthVerdict
    ) -> dict[str, Any] | None:
        """Run the non-finite locator on the failing step, log and warn its report; returns it as a dict."""
        assert replayed.bad_step is not None
        found = self._diagnose(trainer, pl_module, snapshot, replayed.bad_step)
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
        self._emit(
            trainer,
            EventKind.DIAGNOSIS,
            replayed.bad_step,
            announce=False,  # warned below, with the whole report
            report=text,
            op=found_dict and found_dict["op"],
            module=found_dict and found_dict["module_path"],
            phase=found_dict and found_dict["phase"],
            optimizer=found_dict and found_dict["optimizer"],
            parameter=found_dict and found_dict["parameter"],
        )
        rank_zero_warn(f"NaNRollbackCallback diagnosis at step {replayed.bad_step}:\n{text}")
        return found_dict

    def _skip_cap_reached(self, verdict: HealthVerdict) -> bool:
        assert verdict.bad_step is not None
        wanted = self._skip_steps | set(range(verdict.bad_step, verdict.bad_step + self.skip_batches))
        return len(wanted) > self.max_skipped_steps

    def _apply_policy(self, trainer: pl.Trainer, verdict: HealthVerdict) -> None:
        """``skip``: drop the updates of ``skip_batches`` batches from the bad one; ``lower_lr``: scale every LR."""
        assert verdict.bad_step is not None
        if self.policy == "skip":
            skipped = list(range(verdict.bad_step, verdict.bad_step + self.skip_batches))
            self._skip_steps.update(skipped)
            self._emit(trainer, EventKind.POLICY, verdict.bad_step, policy="skip", skipped_steps=skipped)
        else:
            self._lr_scale *= self.lr_factor
            self._emit(trainer, EventKind.POLICY, verdict.bad_step, policy="lower_lr", lr_scale=self._lr_scale)

    def _stop(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        incident: dict[str, Any],
        why: str,
        weights_from: Snapshot | None = None,
    ) -> None:
        """Stop training with finite weights: those of ``weights_from`` (weights and optimizer only), else of
        the newest snapshot every rank loads, else the current ones when they are finite on every rank;
        raise when none exists."""
        stopped_at = max(trainer.global_step, int(incident.get("detected_at", trainer.global_step)))
        snapshot = weights_from if weights_from is not None else self._latest_snapshot(trainer)
        if weights_from is not None:
            weights_from.restore_weights(trainer, pl_module)
            weights = f"Weights restored to the snapshot of step {weights_from.step}"
        elif snapshot is not None:
            self._restore(trainer, pl_module, snapshot)
            weights = f"Weights restored to the snapshot of step {snapshot.step}"
        else:
            finite = all(bool(torch.isfinite(local(p.detach())).all()) for p in pl_module.parameters())
            if not trainer.strategy.reduce_boolean_decision(finite, all=True):
                self._emit(trainer, EventKind.STOPPED, incident["step"], why=why, weights_at_step=None)
                raise RuntimeError(
                    f"NaNRollbackCallback cannot stop with finite weights: {why}, no snapshot loads on every rank "
                    "and the current weights are not finite. HINT: keep more snapshots (`keep_snapshots`) or "
                    "resume from an earlier checkpoint."
                )
            weights = f"No snapshot loads on every rank: the weights are the current (finite) ones of step {stopped_at}"
        self.stopped = True
        trainer.should_stop = True
        incident["outcome"] = Outcome.STOPPED.value
        # the regression trigger's metric when the restored snapshot was taken
        metric = None
        if snapshot is not None and self.regression is not None and snapshot.step in self._snapshot_metric:
            metric = {self.regression.monitor: self._snapshot_metric[snapshot.step]}
        self.stop_report = {
            "why": why,
            "weights_at_step": snapshot.step if snapshot is not None else stopped_at,
            "weights_metric": metric,
            "stopped_at_step": stopped_at,
            "policy": self.policy,
            "skipped_steps": sorted(self._skip_steps),
            "lr_scale": self._lr_scale,
            **_public(incident),
        }
        self._emit(trainer, EventKind.STOPPED, incident["step"], announce=False, **self.stop_report)
        rank_zero_warn(f"NaNRollbackCallback stopped training: {why}. {weights}; see the health event log.")

    # ---------------------------------------------------------------- rollback and replay
    def _rolls_back(self, verdict: HealthVerdict) -> bool:
        return verdict.reason != HealthReason.LOSS_SPIKE or self.rollback_on_spike

    def _apply_lr_scale(self, trainer: pl.Trainer, snapshot_scale: float) -> None:
        ratio = self._lr_scale / snapshot_scale
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

    def _restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule, snapshot: Snapshot) -> None:
        assert self._health is not None
        if not snapshot.rollout and isinstance(pl_module, RolloutStateful) and pl_module.rollout_state_dict():
            rank_zero_warn(
                f"NaNRollbackCallback: the snapshot of step {snapshot.step} has no rollout state (the module created "
                "it later), so the replay starts from the current one and is not bitwise. HINT: create the rollout "
                "state before `on_train_start` (e.g. in the module's `on_fit_start`)."
            )
        snapshot.restore(trainer, pl_module)
        self._health.load_state_dict(copy.deepcopy(snapshot.callback_state))
        self._apply_lr_scale(trainer, snapshot.lr_scale)

    def _entries(self, first: int, end: int) -> list[ReplayEntry]:
        entries = [entry for entry in self._buffer if first <= entry.step < end]
        if [entry.step for entry in entries] != list(range(first, end)):
            raise RuntimeError(f"NaNRollbackCallback: batches for steps {first}..{end - 1} are not all recorded")
        return entries

    def _replay(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, snapshot: Snapshot, end: int
    ) -> HealthVerdict:
        """Restore ``snapshot`` and replay up to step ``end`` (exclusive), checking after every step."""
        assert self._health is not None
        self._restore(trainer, pl_module, snapshot)
        with silenced_logging(pl_module):
            for entry in self._entries(snapshot.step, end):
                self._health.begin_step(entry.step)
                outputs = run_step(trainer, pl_module, entry)
                self._health.end_step(entry.step, outputs)
                verdict = self._health.check_steps(trainer, pl_module, entry.step, entry.step + 1)
                if not verdict.healthy and self._rolls_back(verdict):
                    return verdict
        return HealthVerdict(snapshot.step, end, healthy=True)

    def _diagnose(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, snapshot: Snapshot, bad_step: int
    ) -> NonFiniteOp | None:
        """Replay up to ``bad_step`` and run that step under the non-finite locator."""
        assert self._health is not None
        self._restore(trainer, pl_module, snapshot)
        with silenced_logging(pl_module):
            for entry in self._entries(snapshot.step, bad_step):
                self._health.begin_step(entry.step)
                run_step(trainer, pl_module, entry)
            entry = self._entries(bad_step, bad_step + 1)[0]
            call_replay_hooks(trainer, pl_module, entry)  # reseeded like the original step and the replays
            # DDP's no_sync: the diagnosis backward must not all-reduce (the other ranks run no such step)
            no_sync = getattr(trainer.strategy.model, "no_sync", None)
            with contextlib.ExitStack() as stack:
                if callable(no_sync):
                    stack.enter_context(no_sync())
                if isinstance(pl_module, UncapturedSteps):
                    # a captured graph is one opaque launch: run the step eagerly so the locator sees its ops
                    stack.enter_context(pl_module.uncaptured_steps())
                # several ranks: each runs the whole step, since a sharded module's forward and backward hold
                # collectives (FSDP2, tensor parallel) that a rank stopping at its first find would leave waiting
                lockstep = distributed(trainer)
                found = locate_nonfinite(
                    lambda: pl_module.training_step(clone_batch(entry.batch), entry.batch_idx),
                    module=pl_module,
                    backward=pl_module.automatic_optimization,
                    internal_files=self._plumbing_files,
                    complete_step=lockstep,
                )
                # forward and backward stayed finite (on some rank): the update itself may have gone non-finite
                update_needed = found is None
                if lockstep:
                    update_needed = not trainer.strategy.reduce_boolean_decision(found is not None, all=True)
                if update_needed and pl_module.automatic_optimization:
                    in_update = locate_nonfinite_update(
                        trainer.optimizers, pl_module, internal_files=self._plumbing_files
                    )
                    found = found or in_update
        for optimizer in trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return found


_PHASE_ORDER = {"before": 0, "forward": 1, "backward": 2, "optimizer": 3}


def _public(incident: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in incident.items() if k != "step"} | {"incident_step": incident["step"]}
