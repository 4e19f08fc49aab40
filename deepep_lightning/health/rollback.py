"""NaNRollbackCallback: roll back to the last healthy snapshot, replay, tell transient from reproducible."""

from __future__ import annotations

import copy
import logging
import os
import shutil
import uuid
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from deepep_lightning import _checks
from deepep_lightning._lightning_compat import is_last_batch
from deepep_lightning._sharded import local
from deepep_lightning.health import _step_hooks, _step_skip, recovery
from deepep_lightning.health._replay import Replayer
from deepep_lightning.health._step_skip import StepSkip
from deepep_lightning.health.events import EventKind, run_log_dir
from deepep_lightning.health.flags import HealthReason
from deepep_lightning.health.health_callback import NumericalHealthCallback
from deepep_lightning.health.incident import Classification, Incident, Outcome
from deepep_lightning.health.policy import POLICIES, AppliedPolicy, Policy
from deepep_lightning.health.recovery import FailureRecovery
from deepep_lightning.health.regression import RegressionTrigger, RegressionVerdict
from deepep_lightning.health.regression_handling import RegressionHandler
from deepep_lightning.health.sharded_layouts import check_sharded_layout
from deepep_lightning.health.snapshot import Snapshot, SnapshotRing
from deepep_lightning.health.snapshot_file import prepare_writable_directory
from deepep_lightning.health.stop import FiniteStop
from deepep_lightning.health.verdict import HealthVerdict

__all__ = ["Classification", "NaNRollbackCallback", "Outcome", "Policy"]

log = logging.getLogger(__name__)


class NaNRollbackCallback(Callback):
    r"""Survive NaN/Inf and loss spikes: roll back to a healthy snapshot, replay, and decide.

    Works with a :class:`~deepep_lightning.NumericalHealthCallback` in the same trainer (it
    detects; this callback acts). After every healthy check that is at least
    ``snapshot_every_n_steps`` steps past the last snapshot (and at every epoch's last batch)
    it keeps a snapshot: model, optimizers, LR schedulers, AMP scaler, RNG, loop counters and
    the module's rollout state (when it implements
    :class:`~deepep_lightning.protocols.RolloutStateful`). It also keeps a private copy of each batch since the oldest
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
       ``"skip"`` the ``skip_batches`` batches from the bad one (the step runs on every rank and
       returns its loss, but its optimizer step is not taken; the data position advances; at most
       ``max_skipped_steps`` in a run), ``"lower_lr"`` multiplies every LR by ``lr_factor``, or
       ``"stop"`` — and the replay is retried, at most ``max_retries`` times, from a snapshot
       strictly older than the bad step, one snapshot further back per retry (the bad step's
       loss is a function of the state before it, so only an earlier restart can change it:
       the PaLM recipe; ``keep_snapshots`` bounds how far back);
    4. when giving up, the model is left at the last healthy snapshot (never NaN; with no usable
       snapshot, the current weights if finite, else :class:`RuntimeError`), a report is logged
       and checkpointed (``stop_report``), and the trainer stops cleanly (``trainer.should_stop``).
       A checkpoint written after the stop resumes training from those weights, with a warning
       naming the stop.

    Every event goes to the health event log (JSON lines in the run's log directory, and
    TensorBoard) and is printed on rank 0 as one line through Lightning's ``rank_zero_info``
    (shown by default; a diagnosis and a stop warn with ``rank_zero_warn`` instead). After each
    check, once it is acted on, ``health/events`` and ``health/incidents`` are logged through
    ``pl_module.log`` (see :class:`~deepep_lightning.NumericalHealthCallback`). The
    ``deepep_lightning`` logger carries debug details only.

    Decisions are rank-consistent under DDP: the health verdict is agreed, the snapshot restored
    is the newest one that every rank can load, a skipped step is skipped on every rank, and a
    monitored metric is averaged over ranks.

    Sharded modules (FSDP2's ``fully_shard`` or tensor parallel under ``ModelParallelStrategy``): each
    rank checks and snapshots its local shards (parameters and optimizer state) and restores them in
    place into the live ``DTensor``\s; the verdict and the snapshot restored are agreed as under DDP.
    Optimizers whose state is not laid out like the parameters, and CPU offload, are refused at fit
    start (:mod:`~deepep_lightning.health.sharded_layouts`).

    Guarantee scope: bitwise replay needs deterministic kernels (``docs/determinism.md``) and
    ``accumulate_grad_batches=1``; batches are copied at ``on_train_batch_start`` (host memory
    grows with ``keep_snapshots × snapshot_every_n_steps`` batches).

    Manual optimisation and CUDA graphs (e.g. DeepEP with ``ExecutionConfig(cuda_graph=True)``): the step's outputs
    must carry ``"loss"`` (and ``"grad_norm"``, standing in for the gradients no hook sees; see
    :func:`~deepep_lightning.protocols.step_grad_norm`). A replay calls ``training_step`` again,
    which replays the graph on the restored tensors: every restore copies in place, so the
    graph's pointers stay valid. A skipped step has already updated the weights inside
    ``training_step``, so its update is undone in place (parameters and optimizer state; its
    rollout, i.e. data position, stays). ``lower_lr`` needs a module that captures its graph
    again when the learning rate changes. The locator runs the bad step under the module's
    ``uncaptured_steps()`` when it implements :class:`~deepep_lightning.protocols.UncapturedSteps`,
    to see the ops inside the graph. The bitwise guarantee holds for snapshots taken after the
    graph was captured (steps run eagerly before the capture match the graph to fp32 rounding).

    Args:
        snapshot_every_n_steps: minimum steps between snapshots (taken only at healthy checks).
        keep_snapshots: size of the ring (at most 1000); older ones are the fallback if a newer file is corrupt.
        snapshot_dir: write snapshots there (atomic, checksummed files) instead of host memory;
            a relative path is inside the run's log directory. A snapshot that cannot be written
            (a full disk) warns, naming the path and the sizes, and the previous one stays the newest.
        snapshot_max_bytes: the most bytes the snapshot files of one rank may take in
            ``snapshot_dir`` (older snapshots are removed first; the newest is always kept);
            ``None``: half the space free there at setup, split between the processes of a node.
            ``setup`` says where the snapshots go and how much they may use.
        policy: ``"skip"``, ``"lower_lr"`` or ``"stop"`` for reproducible failures.
        skip_batches: batches skipped from the bad one under ``policy="skip"``.
        lr_factor: LR multiplier under ``policy="lower_lr"``, in (0, 1).
        max_retries: policy applications per incident before stopping (>= 0).
        max_skipped_steps: the most steps ``policy="skip"`` may skip over the whole run (a NaN on
            every step, e.g. an infinite learning rate, must not skip all of training); past it the
            run stops with a report.
        locate: run the non-finite locator on reproducible failures.
        rollback_on_spike: treat a confirmed loss spike like a non-finite value.
        regression: also roll back when a monitored metric collapses (a
            :class:`~deepep_lightning.health.regression.RegressionTrigger`): restore the weights and
            optimizer state of the snapshot with the best value, then ``policy`` — ``"lower_lr"``
            scales every LR, ``"skip"`` drops the steps since that snapshot (the data moves on), and
            ``"stop"`` stops — at most ``max_retries`` times per collapse: a collapse is over (``recovered``)
            once the metric sets a new best or holds within the threshold for ``patience`` checks.

    Raises:
        MisconfigurationException: an invalid argument, or no NumericalHealthCallback in the trainer; at
            fit start, a sharded module (FSDP2, tensor parallel) whose optimizer or CPU offload its
            snapshots cannot serve (:mod:`~deepep_lightning.health.sharded_layouts`).

    Example::

        trainer = Trainer(callbacks=[NumericalHealthCallback(check_every_n_steps=10),
                                     NaNRollbackCallback(snapshot_every_n_steps=100, policy="skip")])
    """

    # the frames a diagnosis runs through on its way to the step: never reported as the user's code
    _plumbing_files = (__file__, recovery.__file__, _step_hooks.__file__, _step_skip.__file__)

    def __init__(
        self,
        snapshot_every_n_steps: int = 100,
        keep_snapshots: int = 2,
        snapshot_dir: str | None = None,
        snapshot_max_bytes: int | None = None,
        policy: Policy = "skip",
        skip_batches: int = 1,
        lr_factor: float = 0.5,
        max_retries: int = 3,
        max_skipped_steps: int = 100,
        locate: bool = True,
        rollback_on_spike: bool = True,
        regression: RegressionTrigger | None = None,
    ) -> None:
        self.snapshot_every_n_steps: int = _checks.int_at_least(
            None, "snapshot_every_n_steps", snapshot_every_n_steps, 1
        )
        # each snapshot is a full copy of model and optimizer state (host memory or disk)
        self.keep_snapshots: int = _checks.int_in_range(None, "keep_snapshots", keep_snapshots, 1, 1000)
        self.policy: Policy = _checks.choice(None, "policy", policy, POLICIES)
        self.skip_batches: int = _checks.int_at_least(None, "skip_batches", skip_batches, 1)
        _checks.number(
            None, "lr_factor", lr_factor, minimum=0, maximum=1, exclusive_minimum=True, exclusive_maximum=True
        )
        self.lr_factor = float(lr_factor)
        self.max_retries: int = _checks.int_at_least(None, "max_retries", max_retries, 0)
        self.max_skipped_steps: int = _checks.int_at_least(None, "max_skipped_steps", max_skipped_steps, 1)
        writable = isinstance(snapshot_dir, (str, os.PathLike)) and os.path.isabs(os.fspath(snapshot_dir))
        directory = _checks.path(None, "snapshot_dir", snapshot_dir, writable_parent=writable, allow_none=True)
        self.snapshot_dir = None if directory is None else os.fspath(directory)
        self.snapshot_max_bytes: int | None = _checks.positive_int(
            None, "snapshot_max_bytes", snapshot_max_bytes, allow_none=True
        )
        self.locate = _checks.strict_bool(None, "locate", locate)
        self.rollback_on_spike = _checks.strict_bool(None, "rollback_on_spike", rollback_on_spike)
        if regression is not None and not isinstance(regression, RegressionTrigger):
            raise MisconfigurationException(
                f"`NaNRollbackCallback(regression=...)` must be a RegressionTrigger or None, got {regression!r}."
            )
        self.regression = regression
        self.ring = SnapshotRing(self.keep_snapshots)
        self.incidents: list[Incident] = []
        self.stopped = False
        self.stop_report: dict[str, Any] | None = None
        self.resumed_stop_report: dict[str, Any] | None = None  # the stop a resumed checkpoint was written after
        self._applied = AppliedPolicy(self.policy, self.skip_batches, self.lr_factor, self.max_skipped_steps)
        self._regression = (
            RegressionHandler(regression, self._applied, self.max_retries, self._emit, self._snapshot)
            if regression is not None
            else None
        )
        self._health: NumericalHealthCallback | None = None
        # built at setup, where the health callback and the snapshot ring are known
        self._replayer: Replayer | None = None
        self._recovery: FailureRecovery | None = None
        self._finite_stop: FiniteStop | None = None
        self._last_snapshot_step: int | None = None
        self._step_skip = StepSkip(self.skips)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(snapshot_every_n_steps=self.snapshot_every_n_steps, policy=self.policy)

    def monitored_metrics(self) -> tuple[str, ...]:
        """The regression trigger's metric, read at each check (``MonitorsMetrics``)."""
        return (self.regression.monitor,) if self.regression is not None else ()

    # ---------------------------------------------------------------- wiring
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # trainer.callbacks is set by Lightning's callback connector, outside Trainer.__init__ (mypy misses it)
        health = [cb for cb in trainer.callbacks if isinstance(cb, NumericalHealthCallback)]  # type: ignore[attr-defined]
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
        self._health.attach_rollback(self)
        if self.snapshot_dir is not None:
            directory = self.snapshot_dir
            if not os.path.isabs(directory):
                directory = os.path.join(run_log_dir(trainer), directory)
            directory = os.path.join(directory, f"rank{trainer.global_rank}")
            try:
                prepare_writable_directory(directory)
            except OSError as error:
                raise MisconfigurationException(
                    f"`NaNRollbackCallback(snapshot_dir={self.snapshot_dir!r})` must be a writable directory: "
                    f"cannot write in {directory!r} ({error.strerror or error})."
                ) from error
            # one id for all ranks: every file of this run carries it, and files without it are refused
            run_id = trainer.strategy.broadcast(uuid.uuid4().hex[:12], src=0)
            # the ranks of a node share its disk: half the free space, split between them
            max_bytes = self.snapshot_max_bytes or shutil.disk_usage(directory).free // (2 * trainer.num_devices)
            self.ring = SnapshotRing(self.keep_snapshots, directory, run_id=run_id, max_bytes=max_bytes)
            rank_zero_info(
                f"NaNRollbackCallback: snapshots in {directory!r} (one directory per rank), at most"
                f" {self.keep_snapshots} and {max_bytes} bytes ({max_bytes / 2**20:.1f} MiB) per rank"
            )
        else:
            rank_zero_info(f"NaNRollbackCallback: snapshots in host memory, at most {self.keep_snapshots}")
        self._replayer = Replayer(self._health, self._applied, self._rolls_back, self._plumbing_files)
        self._finite_stop = FiniteStop(
            self._replayer, self.ring, self._applied, self._regression, self._emit, self._stopped_with
        )
        self._recovery = FailureRecovery(
            self._replayer,
            self.ring,
            self._applied,
            self.max_retries,
            self.locate,
            self._emit,
            self._finite_stop,
            self._snapshot,
        )
        self._step_skip.install(trainer, pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._step_skip.remove(pl_module)
        if self._health is not None:
            self._health.detach_rollback()

    def skips(self, step: int) -> bool:
        """Whether optimizer step ``step`` is skipped (its update dropped; the health checks ignore it)."""
        return self.stopped or self._applied.skips(step)

    # ---------------------------------------------------------------- snapshots
    def _snapshot(self, trainer: pl.Trainer, pl_module: pl.LightningModule, metric: float | None = None) -> None:
        assert self._health is not None and self._replayer is not None
        snapshot = Snapshot.capture(trainer, pl_module, self._health.state_dict(), self._applied.lr_scale)
        self._last_snapshot_step = snapshot.step  # a write that failed is tried again a full interval later
        if not self.ring.push(snapshot):
            return
        if self._regression is not None:  # the snapshot with the best metric is kept beyond the ring's size
            self.ring.pinned = self._regression.note_snapshot(snapshot.step, metric, self.ring.steps())
        self._replayer.drop_before(self.ring.steps()[0])

    # ---------------------------------------------------------------- the training loop
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the strategy's setup: configure_model has sharded the module and the optimizers exist
        check_sharded_layout(pl_module, trainer.optimizers)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # each rank its own shards, no collective; then one decision for all ranks
        finite = all(bool(torch.isfinite(local(p.detach())).all()) for p in pl_module.parameters())
        if not trainer.strategy.reduce_boolean_decision(finite, all=True):
            raise RuntimeError("NaNRollbackCallback: the model has non-finite parameters before training starts.")
        assert self._replayer is not None
        self._replayer.clear()
        self._snapshot(trainer, pl_module)
        report = self.resumed_stop_report
        if report is not None:
            self.resumed_stop_report = None
            rank_zero_warn(
                f"NaNRollbackCallback: this checkpoint was written after a rollback stop at step "
                f"{report.get('stopped_at_step')} ({report.get('why')}); its weights are those of step "
                f"{report.get('weights_at_step')}. Training continues from them at step {trainer.global_step}."
            )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self._replayer is not None
        self._replayer.record(trainer.global_step, batch, batch_idx, trainer.current_epoch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._health is not None and self._replayer is not None
        is_last = is_last_batch(trainer)
        self._replayer.mark_last_batch(is_last)
        self._health.end_step(trainer.global_step - 1, outputs)
        if self.stopped:
            return
        verdict = self._health.poll(trainer, pl_module)
        if verdict is None:
            return
        self._handle_check(trainer, pl_module, verdict, is_last)
        self._health.log_check(pl_module)

    def _handle_check(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, verdict: HealthVerdict, is_last: bool
    ) -> None:
        assert self._recovery is not None and self._finite_stop is not None
        if not verdict.healthy and self._rolls_back(verdict):
            assert verdict.bad_step is not None  # every unhealthy verdict names its step
            incident = Incident(verdict.bad_step, str(verdict.reason), detected_at=trainer.global_step)
            self.incidents.append(incident)
            self._recovery.handle(trainer, pl_module, verdict, incident)
            return
        if not verdict.healthy:
            assert verdict.bad_step is not None  # every unhealthy verdict names its step
            self._emit(trainer, EventKind.SPIKE_IGNORED, verdict.bad_step, details=verdict.details)
        # an ignored loss spike still has a metric to judge: a collapse often moves the loss as well
        metric = self._regression.monitored(trainer) if self._regression is not None else None
        if metric is not None and self._regression is not None:
            regression = self._regression.trigger.update(metric, trainer.global_step)
            if regression is RegressionVerdict.COLLAPSED:
                self.incidents.append(self._regression.open_incident(trainer.global_step, metric))
                self._regression.handle(trainer, pl_module, self.incidents[-1], self.ring, self._finite_stop)
                return
            if regression is RegressionVerdict.RECOVERED:
                self._regression.held(trainer, next(i for i in reversed(self.incidents) if i.reason == "regression"))
        if verdict.healthy and (
            is_last or trainer.global_step - (self._last_snapshot_step or 0) >= self.snapshot_every_n_steps
        ):
            self._snapshot(trainer, pl_module, metric)  # never a snapshot of a spiking state

    # ---------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            **self._applied.state_dict(),  # skip_steps, lr_scale
            "incidents": copy.deepcopy([incident.to_dict() for incident in self.incidents]),
            "stopped": self.stopped,
            "stop_report": copy.deepcopy(self.stop_report),
            "regression": self.regression.state_dict() if self.regression is not None else None,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._applied.load_state_dict(state_dict)
        self.incidents = [Incident.from_dict(incident) for incident in state_dict.get("incidents", [])]
        # A checkpoint written after a stop holds the finite weights the stop left (see ``stop_report``);
        # resuming it trains on from them (a stopped state would skip every step), with a warning.
        self.resumed_stop_report = state_dict.get("stop_report") if state_dict.get("stopped", False) else None
        if state_dict.get("stopped", False) and self.resumed_stop_report is None:
            self.resumed_stop_report = {"why": "unknown (a checkpoint without a stop report)"}
        self.stopped = False
        self.stop_report = None
        if self.regression is not None and state_dict.get("regression") is not None:
            self.regression.load_state_dict(state_dict["regression"])

    # ---------------------------------------------------------------- actions of an incident
    def _emit(
        self, trainer: pl.Trainer, kind: EventKind, step: int, announce: bool = True, **fields: Any
    ) -> dict[str, Any]:
        assert self._health is not None
        return self._health.events.emit(trainer, kind, step, announce=announce, **fields)

    def _rolls_back(self, verdict: HealthVerdict) -> bool:
        return verdict.reason != HealthReason.LOSS_SPIKE or self.rollback_on_spike

    def _stopped_with(self, report: dict[str, Any]) -> None:
        self.stopped = True
        self.stop_report = report
