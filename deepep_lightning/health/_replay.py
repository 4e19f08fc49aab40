"""Re-running recorded training steps through Lightning's own optimization loop: the :class:`Replayer`.

A replay calls the very objects the fit loop calls (``automatic_optimization.run``
or ``manual_optimization.run``), so closure, backward, precision plugin,
gradient clipping, ``optimizer_step`` and every callback hook run exactly as in
the original step: with the same state, batch and RNG, the same bits come out.
Logging is silenced during a replay (the step was already logged), and
LR schedulers with ``interval="step"`` are stepped as the epoch loop does.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from deepep_lightning._lightning_compat import run_optimization_step
from deepep_lightning._patches import silenced_logging
from deepep_lightning.audit.nonfinite import NonFiniteOp, locate_nonfinite, locate_nonfinite_update
from deepep_lightning.health._collectives import distributed
from deepep_lightning.health.health_callback import NumericalHealthCallback
from deepep_lightning.health.policy import AppliedPolicy
from deepep_lightning.health.snapshot import Snapshot
from deepep_lightning.health.verdict import HealthVerdict
from deepep_lightning.protocols import ReplayAware, RolloutStateful, UncapturedSteps

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


class Replayer:
    """The batches of the steps since the oldest snapshot, and the restore, replay and diagnosis that rerun them.

    Each batch is copied when its step starts (:meth:`record`), so any map-style or iterable data can be
    replayed; copies older than the oldest snapshot are dropped (:meth:`drop_before`). A replay restores
    a snapshot and runs the recorded steps after it through Lightning's loop, checking each one.

    Args:
        health: the trainer's :class:`~deepep_lightning.NumericalHealthCallback`: it checks every replayed
            step, and its state is restored with each snapshot.
        applied_policy: brings the learning rates of a restored snapshot to the policy's current scale.
        stops_replay: whether a failed check ends a replay (a loss spike the rollback ignores does not).
        internal_files: the frames a diagnosis runs through on its way to the step (the callback's own
            files): never reported as the user's code.

    Example::

        replayer = Replayer(health, applied_policy, stops_replay=lambda verdict: True, internal_files=())
        verdict = replayer.replay(trainer, pl_module, snapshot, end=trainer.global_step)
    """

    def __init__(
        self,
        health: NumericalHealthCallback,
        applied_policy: AppliedPolicy,
        stops_replay: Callable[[HealthVerdict], bool],
        internal_files: Iterable[str],
    ) -> None:
        self.health = health
        self.applied_policy = applied_policy
        self.stops_replay = stops_replay
        self.internal_files = (__file__, *internal_files)
        self._recorded: list[ReplayEntry] = []

    # ---------------------------------------------------------------- the recorded batches
    def record(self, step: int, batch: Any, batch_idx: int, epoch: int) -> None:
        """Keep a private copy of the batch of ``step`` (a step started again replaces its earlier copy)."""
        entry = ReplayEntry(step, clone_batch(batch), batch_idx, epoch)
        if self._recorded and self._recorded[-1].step == entry.step:
            self._recorded[-1] = entry
        else:
            self._recorded.append(entry)

    def mark_last_batch(self, is_last: bool) -> None:
        """Note whether the step recorded last ran its epoch's last batch (a replay then steps epoch schedulers)."""
        if self._recorded:
            self._recorded[-1].is_last_batch = is_last

    def drop_before(self, step: int) -> None:
        """Forget the batches of the steps before ``step`` (no snapshot restarts before it)."""
        self._recorded = [entry for entry in self._recorded if entry.step >= step]

    def clear(self) -> None:
        self._recorded = []

    def _entries(self, first: int, end: int) -> list[ReplayEntry]:
        entries = [entry for entry in self._recorded if first <= entry.step < end]
        if [entry.step for entry in entries] != list(range(first, end)):
            raise RuntimeError(f"NaNRollbackCallback: batches for steps {first}..{end - 1} are not all recorded")
        return entries

    # ---------------------------------------------------------------- running them again
    def restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule, snapshot: Snapshot) -> None:
        """Restore ``snapshot`` (the whole training state and the health callback's), at the current LR scale."""
        if not snapshot.rollout and isinstance(pl_module, RolloutStateful) and pl_module.rollout_state_dict():
            rank_zero_warn(
                f"NaNRollbackCallback: the snapshot of step {snapshot.step} has no rollout state (the module created "
                "it later), so the replay starts from the current one and is not bitwise. HINT: create the rollout "
                "state before `on_train_start` (e.g. in the module's `on_fit_start`)."
            )
        snapshot.restore(trainer, pl_module)
        self.health.load_state_dict(copy.deepcopy(snapshot.callback_state))
        self.applied_policy.scale_learning_rates(trainer, snapshot.lr_scale)

    def replay(self, trainer: pl.Trainer, pl_module: pl.LightningModule, snapshot: Snapshot, end: int) -> HealthVerdict:
        """Restore ``snapshot`` and replay up to step ``end`` (exclusive), checking after every step."""
        self.restore(trainer, pl_module, snapshot)
        with silenced_logging(pl_module):
            for entry in self._entries(snapshot.step, end):
                self.health.begin_step(entry.step)
                outputs = run_step(trainer, pl_module, entry)
                self.health.end_step(entry.step, outputs)
                verdict = self.health.check_steps(trainer, pl_module, entry.step, entry.step + 1)
                if not verdict.healthy and self.stops_replay(verdict):
                    return verdict
        return HealthVerdict(snapshot.step, end, healthy=True)

    def diagnose(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, snapshot: Snapshot, bad_step: int
    ) -> NonFiniteOp | None:
        """Replay up to ``bad_step`` and run that step under the non-finite locator."""
        self.restore(trainer, pl_module, snapshot)
        with silenced_logging(pl_module):
            for entry in self._entries(snapshot.step, bad_step):
                self.health.begin_step(entry.step)
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
                    internal_files=self.internal_files,
                    complete_step=lockstep,
                )
                # forward and backward stayed finite (on some rank): the update itself may have gone non-finite
                update_needed = found is None
                if lockstep:
                    update_needed = not trainer.strategy.reduce_boolean_decision(found is not None, all=True)
                if update_needed and pl_module.automatic_optimization:
                    in_update = locate_nonfinite_update(
                        trainer.optimizers, pl_module, internal_files=self.internal_files
                    )
                    found = found or in_update
        for optimizer in trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return found
