"""NaNRollbackCallback: roll back to the last healthy snapshot, replay, tell transient from reproducible."""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from deepep_lightning.audit.nonfinite import locate_nonfinite
from deepep_lightning.health._replay import ReplayEntry, call_replay_hooks, clone_batch, run_step, silenced_logging
from deepep_lightning.health._step_hooks import add_step_hook, remove_step_hook
from deepep_lightning.health.events import run_log_dir
from deepep_lightning.health.health_callback import HealthVerdict, NumericalHealthCallback, _check_choice, _check_int
from deepep_lightning.health.snapshot import Snapshot, SnapshotRing, clone_update_state, restore_update_state

__all__ = ["NaNRollbackCallback"]

log = logging.getLogger(__name__)

_POLICIES = ("skip", "lower_lr", "stop")


class NaNRollbackCallback(Callback):
    r"""Survive NaN/Inf and loss spikes: roll back to a healthy snapshot, replay, and decide.

    Works with a :class:`~deepep_lightning.NumericalHealthCallback` in the same trainer (it
    detects; this callback acts). After every healthy check that is at least
    ``snapshot_every_n_steps`` steps past the last snapshot (and at every epoch's last batch)
    it keeps a snapshot: model, optimizers, LR schedulers, AMP scaler, RNG, loop counters and
    the module's rollout state (``rollout_state_dict()``/``load_rollout_state_dict(d)`` when
    the module defines them). It also keeps a private copy of each batch since the oldest
    snapshot, so any map-style or iterable data can be replayed.

    On a failed check (non-finite loss, gradient or parameter; or a loss spike when
    ``rollback_on_spike``), inside the same ``on_train_batch_end``:

    1. restore the last healthy snapshot and **replay** the recorded steps through Lightning's
       own optimization loop; the step counters are rewound for the replay and end where they
       were, so ``trainer.global_step`` never double-counts;
    2. clean replay ⇒ *transient fault*: logged, training continues, and the weights equal bit
       for bit those of a run that never had the fault (same steps, same batches, same RNG);
    3. the same failure again ⇒ *reproducible numerical bug*: the non-finite locator replays
       the bad step under a dispatch mode and names the op; then ``policy`` is applied —
       ``"skip"`` the ``skip_batches`` batches from the bad one (their update is dropped, their
       data position still advances), ``"lower_lr"`` multiplies every LR by ``lr_factor``, or
       ``"stop"`` — and the replay is retried, at most ``max_retries`` times, from a snapshot
       strictly older than the bad step, one snapshot further back per retry (the bad step's
       loss is a function of the state before it, so only an earlier restart can change it:
       the PaLM recipe; ``keep_snapshots`` bounds how far back);
    4. when giving up, the model is left at the last healthy snapshot (never NaN), a report is
       logged, and the trainer stops cleanly (``trainer.should_stop``; no later step updates).

    Every event goes to the health event log (JSON lines in the run's log directory, and
    TensorBoard). Decisions are rank-consistent under DDP (the health verdict is agreed).

    Guarantee scope: bitwise replay needs deterministic kernels (see ``DESIGN.md``) and
    ``accumulate_grad_batches=1``; batches are copied at ``on_train_batch_start`` (host memory
    grows with ``keep_snapshots × snapshot_every_n_steps`` batches).

    Manual optimisation and CUDA graphs (``DeepEPModule(cuda_graph=True)``): the step's outputs
    must carry ``"loss"`` (and ``"grad_norm"``, standing in for the gradients no hook sees). A
    replay calls ``training_step`` again, which replays the graph on the restored tensors: every
    restore copies in place, so the graph's pointers stay valid (a replaced tensor makes
    ``GraphedTrainStep`` refuse to replay). A skipped step has already updated the weights inside
    ``training_step``, so its update is undone in place (parameters and optimizer state; its
    rollout, i.e. data position, stays). ``lower_lr`` works because a changed learning rate makes
    the module capture its graph again on the next step. The locator runs the bad step under the
    module's ``uncaptured_steps()`` when it has one, to see the ops inside the graph. The
    bitwise guarantee holds for snapshots taken after the graph was captured (the first
    ``warmup_steps`` steps run eagerly; replaying them through the graph matches to fp32 rounding).

    Args:
        snapshot_every_n_steps: minimum steps between snapshots (taken only at healthy checks).
        keep_snapshots: size of the ring; older ones are the fallback if a newer file is corrupt.
        snapshot_dir: write snapshots there (atomic, checksummed files) instead of host memory;
            a relative path is inside the run's log directory.
        policy: ``"skip"``, ``"lower_lr"`` or ``"stop"`` for reproducible failures.
        skip_batches: batches skipped from the bad one under ``policy="skip"``.
        lr_factor: LR multiplier under ``policy="lower_lr"``, in (0, 1).
        max_retries: policy applications per incident before stopping (>= 0).
        locate: run the non-finite locator on reproducible failures.
        rollback_on_spike: treat a confirmed loss spike like a non-finite value.

    Raises:
        MisconfigurationException: an invalid argument, or no NumericalHealthCallback in the trainer.

    Example::

        trainer = Trainer(callbacks=[NumericalHealthCallback(check_every_n_steps=10),
                                     NaNRollbackCallback(snapshot_every_n_steps=100, policy="skip")])
    """

    def __init__(
        self,
        snapshot_every_n_steps: int = 100,
        keep_snapshots: int = 2,
        snapshot_dir: str | None = None,
        policy: str = "skip",
        skip_batches: int = 1,
        lr_factor: float = 0.5,
        max_retries: int = 3,
        locate: bool = True,
        rollback_on_spike: bool = True,
    ) -> None:
        self.snapshot_every_n_steps = _check_int("snapshot_every_n_steps", snapshot_every_n_steps, 1)
        self.keep_snapshots = _check_int("keep_snapshots", keep_snapshots, 1)
        self.policy = _check_choice("policy", policy, _POLICIES)
        self.skip_batches = _check_int("skip_batches", skip_batches, 1)
        if isinstance(lr_factor, bool) or not isinstance(lr_factor, (int, float)) or not 0 < lr_factor < 1:
            raise MisconfigurationException(f"`lr_factor` must be a number in (0, 1), got {lr_factor!r}.")
        self.lr_factor = float(lr_factor)
        self.max_retries = _check_int("max_retries", max_retries, 0)
        if snapshot_dir is not None and not isinstance(snapshot_dir, (str, os.PathLike)):
            raise MisconfigurationException(f"`snapshot_dir` must be a path or None, got {snapshot_dir!r}.")
        self.snapshot_dir = None if snapshot_dir is None else os.fspath(snapshot_dir)
        self.locate = bool(locate)
        self.rollback_on_spike = bool(rollback_on_spike)
        self.ring = SnapshotRing(self.keep_snapshots)
        self.incidents: list[dict[str, Any]] = []
        self.stopped = False
        self.stop_report: dict[str, Any] | None = None
        self._health: NumericalHealthCallback | None = None
        self._buffer: list[ReplayEntry] = []
        self._skip_steps: set[int] = set()
        self._lr_scale = 1.0
        self._last_snapshot_step: int | None = None
        self._undo: tuple[Any, ...] | None = None  # the update state before a skipped manual-optimisation step

    @property
    def state_key(self) -> str:
        return self._generate_state_key(snapshot_every_n_steps=self.snapshot_every_n_steps, policy=self.policy)

    # ---------------------------------------------------------------- wiring
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        health = [cb for cb in trainer.callbacks if isinstance(cb, NumericalHealthCallback)]
        if not health:
            raise MisconfigurationException(
                "NaNRollbackCallback needs a NumericalHealthCallback in `Trainer(callbacks=...)`, found none. "
                "HINT: callbacks=[NumericalHealthCallback(), NaNRollbackCallback()]."
            )
        if trainer.accumulate_grad_batches != 1:
            raise MisconfigurationException(
                f"NaNRollbackCallback replays whole optimizer steps and needs `accumulate_grad_batches=1`, "
                f"got {trainer.accumulate_grad_batches!r}."
            )
        self._health = health[0]
        self._health._delegate = self
        if self.snapshot_dir is not None:
            directory = self.snapshot_dir
            if not os.path.isabs(directory):
                directory = os.path.join(run_log_dir(trainer), directory)
            directory = os.path.join(directory, f"rank{trainer.global_rank}")
            self.ring = SnapshotRing(self.keep_snapshots, directory)
        add_step_hook(
            pl_module,
            "rollback",
            innermost=True,
            post=self._skip_hook,
            pre=lambda step, batch: self._before_step(trainer, pl_module, step, batch),
        )

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        remove_step_hook(pl_module, "rollback")
        self._undo = None
        if self._health is not None:
            self._health._delegate = None

    def _skips(self, step: int) -> bool:
        return self.stopped or step in self._skip_steps

    def _before_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", step: int, batch: Any) -> Any:
        # Returning None skips the update only under automatic optimisation; a manual step (a CUDA
        # graph) updates inside training_step, so keep what it will change and put it back after.
        if self._skips(step) and not pl_module.automatic_optimization:
            self._undo = (clone_update_state(pl_module, trainer.optimizers), pl_module, trainer.optimizers)
        return batch

    def _skip_hook(self, step: int, output: Any) -> Any:
        if not self._skips(step):
            return output
        if self._undo is not None:
            saved, pl_module, optimizers = self._undo
            self._undo = None
            restore_update_state(pl_module, optimizers, saved)
        return None

    def _emit(self, trainer: "pl.Trainer", kind: str, step: int, **fields: Any) -> dict[str, Any]:
        assert self._health is not None
        return self._health.events.emit(trainer, kind, step, **fields)

    # ---------------------------------------------------------------- snapshots
    def _snapshot(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        assert self._health is not None
        snapshot = Snapshot.capture(trainer, pl_module, self._health.state_dict(), self._lr_scale)
        self.ring.push(snapshot)
        self._last_snapshot_step = snapshot.step
        oldest = self.ring.steps()[0]
        self._buffer = [entry for entry in self._buffer if entry.step >= oldest]

    def _latest_snapshot(self, trainer: "pl.Trainer", before_step: int | None = None) -> Snapshot | None:
        def on_corrupt(path: str, error: Exception) -> None:
            self._emit(trainer, "corrupt_snapshot", trainer.global_step, path=path, error=str(error))
            rank_zero_warn(f"NaNRollbackCallback: {error}; falling back to the previous snapshot.")

        return self.ring.latest(on_corrupt, before_step)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        finite = all(bool(torch.isfinite(p.detach()).all()) for p in pl_module.parameters())
        if not finite:
            raise RuntimeError("NaNRollbackCallback: the model has non-finite parameters before training starts.")
        self._buffer = []
        self._snapshot(trainer, pl_module)

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        entry = ReplayEntry(trainer.global_step, clone_batch(batch), batch_idx, trainer.current_epoch)
        if self._buffer and self._buffer[-1].step == entry.step:
            self._buffer[-1] = entry
        else:
            self._buffer.append(entry)

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._health is not None
        is_last = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        if self._buffer:
            self._buffer[-1].is_last_batch = is_last
        self._health.end_step(trainer.global_step - 1, outputs)
        if self.stopped:
            return
        verdict = self._health.poll(trainer, pl_module)
        if verdict is None:
            return
        if not verdict.healthy and (verdict.reason != "loss_spike" or self.rollback_on_spike):
            self._handle_failure(trainer, pl_module, verdict)
        elif not verdict.healthy:
            self._emit(trainer, "spike_ignored", verdict.bad_step, details=verdict.details)
        elif is_last or trainer.global_step - (self._last_snapshot_step or 0) >= self.snapshot_every_n_steps:
            self._snapshot(trainer, pl_module)

    # ---------------------------------------------------------------- rollback and replay
    def _apply_lr_scale(self, trainer: "pl.Trainer", snapshot_scale: float) -> None:
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

    def _restore(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", snapshot: Snapshot) -> None:
        assert self._health is not None
        if not snapshot.rollout and hasattr(pl_module, "rollout_state_dict") and pl_module.rollout_state_dict():
            rank_zero_warn(
                f"NaNRollbackCallback: the snapshot of step {snapshot.step} has no rollout state (the module created it "
                "later), so the replay starts from the current one and is not bitwise. HINT: create the rollout "
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
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", snapshot: Snapshot, end: int
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
                if not verdict.healthy and (verdict.reason != "loss_spike" or self.rollback_on_spike):
                    return verdict
        return HealthVerdict(snapshot.step, end, healthy=True)

    def _diagnose(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", snapshot: Snapshot, bad_step: int
    ) -> Any:
        """Replay up to ``bad_step`` and run that step under the non-finite locator."""
        assert self._health is not None
        self._restore(trainer, pl_module, snapshot)
        with silenced_logging(pl_module):
            for entry in self._entries(snapshot.step, bad_step):
                self._health.begin_step(entry.step)
                run_step(trainer, pl_module, entry)
            entry = self._entries(bad_step, bad_step + 1)[0]
            call_replay_hooks(trainer, pl_module, entry)  # reseeded like the original step and the replays
            no_sync = getattr(trainer.strategy.model, "no_sync", None)
            # a captured graph is one opaque launch: run the step eagerly so the locator sees its ops
            uncaptured = getattr(pl_module, "uncaptured_steps", None)
            with (
                no_sync() if callable(no_sync) else _nullcontext(),
                uncaptured() if callable(uncaptured) else _nullcontext(),
            ):
                found = locate_nonfinite(
                    lambda: pl_module.training_step(clone_batch(entry.batch), entry.batch_idx),
                    module=pl_module,
                    backward=pl_module.automatic_optimization,
                )
        for optimizer in trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return found

    def _handle_failure(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", verdict: HealthVerdict) -> None:
        automatic, manual = (
            trainer.fit_loop.epoch_loop.automatic_optimization,
            trainer.fit_loop.epoch_loop.manual_optimization,
        )
        progress = (
            copy.deepcopy(automatic.optim_progress.state_dict()),
            copy.deepcopy(manual.optim_step_progress.state_dict()),
        )
        end = trainer.global_step
        incident: dict[str, Any] = {
            "step": verdict.bad_step,
            "reason": verdict.reason,
            "detected_at": end,
            "attempts": 0,
        }
        self.incidents.append(incident)
        self._emit(
            trainer, "detected", verdict.bad_step, reason=verdict.reason, details=verdict.details, checked_at=end
        )
        failing = verdict
        restart_before: int | None = None
        try:
            while True:
                snapshot = self._latest_snapshot(trainer)
                if incident["attempts"] > 0:
                    # a changed replay must change the state *before* the bad step (its loss is a function
                    # of that state): restart strictly before it, one snapshot further back per retry
                    before = failing.bad_step if restart_before is None else min(restart_before, failing.bad_step)
                    snapshot = self._latest_snapshot(trainer, before_step=before) or snapshot
                    restart_before = snapshot.step
                if snapshot is None:
                    self._stop(trainer, pl_module, incident, "no healthy snapshot to roll back to")
                    return
                self._emit(trainer, "rollback", snapshot.step, to_step=snapshot.step, replay_until=end)
                replayed = self._replay(trainer, pl_module, snapshot, end)
                if replayed.healthy:
                    incident["outcome"] = "transient" if incident["attempts"] == 0 else "recovered"
                    self._emit(trainer, incident["outcome"], incident["step"], **_public(incident))
                    self._snapshot(trainer, pl_module)
                    return
                if incident["attempts"] == 0:
                    same = replayed.bad_step == failing.bad_step and replayed.reason == failing.reason
                    same = bool(trainer.strategy.reduce_boolean_decision(same, all=True))  # one label on all ranks
                    incident["classification"] = "reproducible" if same else "nondeterministic"
                    self._emit(trainer, incident["classification"], replayed.bad_step, reason=replayed.reason)
                    if self.locate:
                        found = self._diagnose(trainer, pl_module, snapshot, replayed.bad_step)
                        incident["diagnosis"] = found.to_dict() if found is not None else None
                        text = found.describe() if found is not None else "no op produced a non-finite value"
                        self._emit(
                            trainer,
                            "diagnosis",
                            replayed.bad_step,
                            report=text,
                            op=found and found.op,
                            module=found and found.module_path,
                            phase=found and found.phase,
                        )
                        rank_zero_warn(f"NaNRollbackCallback diagnosis at step {replayed.bad_step}:\n{text}")
                if self.policy == "stop" or incident["attempts"] >= self.max_retries:
                    self._stop(trainer, pl_module, incident, f"{replayed.reason} at step {replayed.bad_step} persists")
                    return
                incident["attempts"] += 1
                self._apply_policy(trainer, replayed)
                failing = replayed
        finally:
            automatic.optim_progress.load_state_dict(progress[0])
            manual.optim_step_progress.load_state_dict(progress[1])
            self._health._next_unchecked = end
            self._health._cache = None

    def _apply_policy(self, trainer: "pl.Trainer", verdict: HealthVerdict) -> None:
        if self.policy == "skip":
            skipped = list(range(verdict.bad_step, verdict.bad_step + self.skip_batches))
            self._skip_steps.update(skipped)
            self._emit(trainer, "policy", verdict.bad_step, policy="skip", skipped_steps=skipped)
        else:
            self._lr_scale *= self.lr_factor
            self._emit(trainer, "policy", verdict.bad_step, policy="lower_lr", lr_scale=self._lr_scale)

    def _stop(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", incident: dict[str, Any], why: str) -> None:
        snapshot = self._latest_snapshot(trainer)
        if snapshot is not None:
            self._restore(trainer, pl_module, snapshot)
        self.stopped = True
        trainer.should_stop = True
        incident["outcome"] = "stopped"
        self.stop_report = {
            "why": why,
            "weights_at_step": snapshot.step if snapshot is not None else None,
            "stopped_at_step": trainer.global_step,
            "policy": self.policy,
            "skipped_steps": sorted(self._skip_steps),
            "lr_scale": self._lr_scale,
            **_public(incident),
        }
        self._emit(trainer, "stopped", incident["step"], **self.stop_report)
        rank_zero_warn(
            f"NaNRollbackCallback stopped training: {why}. Weights restored to the snapshot of step "
            f"{self.stop_report['weights_at_step']}; see the health event log."
        )

    # ---------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "skip_steps": sorted(self._skip_steps),
            "lr_scale": self._lr_scale,
            "incidents": copy.deepcopy(self.incidents),
            "stopped": self.stopped,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._skip_steps = set(state_dict.get("skip_steps", []))
        self._lr_scale = float(state_dict.get("lr_scale", 1.0))
        self.incidents = list(state_dict.get("incidents", []))
        self.stopped = bool(state_dict.get("stopped", False))


def _public(incident: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in incident.items() if k != "step"} | {"incident_step": incident["step"]}


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None
