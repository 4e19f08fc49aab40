"""NumericalHealthCallback: finite checks of loss, gradients and parameters without per-step host syncs."""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Literal, get_args

import lightning.pytorch as pl
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from deepep_lightning import _checks
from deepep_lightning._lightning_compat import is_last_batch
from deepep_lightning.health.check_scalars import log_check_scalars, log_epoch_scalar
from deepep_lightning.health.events import DEFAULT_EVENTS_FILENAME, INCIDENT_KINDS, EventKind, HealthEventLog
from deepep_lightning.health.flags import HealthReason, StepFlags
from deepep_lightning.health.parameter_scan import parameter_max_abs
from deepep_lightning.health.spike import LossSpikeDetector
from deepep_lightning.health.verdict import FailureHandler, HealthVerdict, NonFiniteError, agree_across_ranks
from deepep_lightning.protocols import step_grad_norm, step_loss

__all__ = ["Action", "NumericalHealthCallback"]

log = logging.getLogger(__name__)

#: What a failed check does without a rollback: raise :class:`NonFiniteError`, warn, or stop cleanly.
Action = Literal["raise", "warn", "stop"]
_ACTIONS: tuple[str, ...] = get_args(Action)

#: The largest ``check_every_n_steps``: the device table holds a row per step between two checks.
MAX_CHECK_EVERY_N_STEPS = 10_000


class NumericalHealthCallback(Callback):
    r"""Checks that training stays finite, cheaply, and tells you when it does not.

    Every step writes on-device flags (loss finite, gradients finite before the optimizer
    step) and the loss value into a slot; the host reads all slots once every
    ``check_every_n_steps`` steps (and at the end of each epoch and at ``max_steps``), so a
    step costs a few small kernels and **no** host synchronisation. At a check it also tests
    the parameters and feeds the loss spike detector. At each epoch end it checks every
    parameter for NaN/Inf and ``max |w| > param_max_abs``.

    Scalars are logged at each check only, as host values the check has already read: through
    ``pl_module.log`` (so ``EarlyStopping``/``ModelCheckpoint`` can monitor them and
    ``health/incidents`` is in the progress bar; CPU tensors, so neither Lightning nor the bar reads
    the device for them) and to the loggers once, at the step of the check, on the training
    scalars' x-axis (:func:`log_check_scalars`):

    * ``health/events``: health events recorded since the previous check (0 when healthy);
    * ``health/incidents``: failed checks in the run so far (also in the progress bar);
    * ``health/param_norm`` and ``health/loss_z`` (spike detector's z-score), with ``log_norms``;
    * ``health/param_max_abs`` at each epoch end.

    The gradient norm is the training step's to log (DeepEP's ``train/grad_norm``;
    ``lightning.pytorch.utilities.grad_norm`` for any module): the check reads it for its verdict
    but does not log it again.

    Every health event is printed on rank 0 as one line through Lightning's ``rank_zero_info``
    (shown by default), appended to the JSON-lines event log and added to TensorBoard's text tab;
    a failure without a rollback also warns (``rank_zero_warn``). The ``deepep_lightning`` logger
    (``logging.getLogger("deepep_lightning")``) carries debug details only and has no handler by default.

    With a :class:`~deepep_lightning.NaNRollbackCallback` in the trainer, failed checks are
    handed to it (roll back and replay); alone, ``on_nonfinite`` / ``on_spike`` decide.

    The contract with such a handler is public: :meth:`attach_rollback` hands failed checks over
    (this callback then records each step but neither polls nor acts in ``on_train_batch_end``);
    the handler calls :meth:`begin_step`, :meth:`end_step`, :meth:`poll` and :meth:`check_steps`,
    and :meth:`resume_checks_at` after it restored and replayed steps.

    Args:
        check_every_n_steps: steps between host reads; 1 detects on the very step (at most 10,000).
        check_loss / check_gradients: which per-step checks to run. Gradient checks are
            skipped under a ``GradScaler`` (it skips overflowing steps itself).
        on_nonfinite: ``"raise"`` (:class:`NonFiniteError`), ``"warn"`` or ``"stop"`` (clean stop).
        param_max_abs: warn/raise when any ``|w|`` exceeds it at an epoch end (None: off).
        on_large_param: ``"warn"``, ``"raise"`` or ``"stop"``.
        log_norms: log the parameter norm and the loss z-score at each check.
        spike_detection: run the loss spike detector (see :class:`LossSpikeDetector`).
        spike_window / spike_z_threshold / spike_warmup / spike_persistence: its settings.
        on_spike: action without rollback: ``"warn"``, ``"raise"`` or ``"stop"``.
        events_filename: JSON-lines event log in the run's log directory (a file name); when a file of
            that name is already there (another run sharing the directory), the next free
            ``<stem>.<n>.jsonl`` is used instead of appending to it.

    Raises:
        MisconfigurationException: an argument is invalid.

    Example::

        trainer = Trainer(callbacks=[NumericalHealthCallback(check_every_n_steps=10)])
    """

    def __init__(
        self,
        check_every_n_steps: int = 10,
        check_loss: bool = True,
        check_gradients: bool = True,
        on_nonfinite: Action = "raise",
        param_max_abs: float | None = None,
        on_large_param: Action = "warn",
        log_norms: bool = True,
        spike_detection: bool = True,
        spike_window: int = 100,
        spike_z_threshold: float = 6.0,
        spike_warmup: int | None = None,
        spike_persistence: int = 2,
        on_spike: Action = "warn",
        events_filename: str = DEFAULT_EVENTS_FILENAME,
    ) -> None:
        # the flags table holds one row per step between checks: a bound keeps setup from allocating gigabytes
        self.check_every_n_steps: int = _checks.int_in_range(
            None, "check_every_n_steps", check_every_n_steps, 1, MAX_CHECK_EVERY_N_STEPS
        )
        self.on_nonfinite: Action = _checks.choice(None, "on_nonfinite", on_nonfinite, _ACTIONS)
        self.on_large_param: Action = _checks.choice(None, "on_large_param", on_large_param, _ACTIONS)
        self.on_spike: Action = _checks.choice(None, "on_spike", on_spike, _ACTIONS)
        self.param_max_abs: float | None = _checks.number(
            None, "param_max_abs", param_max_abs, minimum=0, exclusive_minimum=True, finite=True, allow_none=True
        )
        self.check_loss = _checks.strict_bool(None, "check_loss", check_loss)
        self.check_gradients = _checks.strict_bool(None, "check_gradients", check_gradients)
        self.log_norms = _checks.strict_bool(None, "log_norms", log_norms)
        _checks.strict_bool(None, "spike_detection", spike_detection)
        self.spike_detector = (
            LossSpikeDetector(spike_window, spike_z_threshold, spike_warmup, spike_persistence)
            if spike_detection
            else None
        )
        _checks.non_empty_str(None, "events_filename", events_filename)
        if os.path.basename(events_filename) != events_filename or events_filename in (".", ".."):
            raise MisconfigurationException(
                f"`events_filename` must be a file name without a directory, got {events_filename!r} "
                "(HINT: the event log is written in the run's log directory)"
            )
        self.events = HealthEventLog(events_filename)
        self.flags: StepFlags | None = None
        self.last_verdict: HealthVerdict | None = None
        self._next_unchecked = 0  # first step not yet read by a check
        self._cache: tuple[int, HealthVerdict] | None = None
        self._handler: FailureHandler | None = None
        self._grad_checks_enabled = True
        self._check_scalars: dict[str, float] = {}  # norms of the last check, logged by log_check()
        self._loss_recorded: int | None = None
        self._grads_recorded: int | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(check_every_n_steps=self.check_every_n_steps)

    # ---------------------------------------------------------------- the contract with a rollback
    def attach_rollback(self, handler: FailureHandler) -> None:
        """Hand failed checks to ``handler``: from now on it polls after each step and decides."""
        self._handler = handler

    def detach_rollback(self) -> None:
        """Act on failed checks again (``on_nonfinite``, ``on_spike``)."""
        self._handler = None

    def resume_checks_at(self, step: int) -> None:
        """Count every step before ``step`` as checked and drop the cached verdict (after a restore and replay)."""
        self._next_unchecked = int(step)
        self._cache = None

    # ---------------------------------------------------------------- per-step recording
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.flags = StepFlags(self.check_every_n_steps, pl_module.device)
        self.events.attach(trainer)
        if trainer.is_global_zero:
            assert self.events.path is not None
            directory = os.path.dirname(self.events.path) or "."
            try:
                os.makedirs(directory, exist_ok=True)
                writable = os.access(directory, os.W_OK | os.X_OK)
            except OSError:
                writable = False
            if not writable:
                raise MisconfigurationException(
                    f"`NumericalHealthCallback(events_filename={self.events.filename!r})` is written in the run's "
                    f"log directory {directory!r}, which is not writable. HINT: `Trainer(default_root_dir=...)` "
                    "or a logger with a writable `save_dir`."
                )
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._grad_checks_enabled = self.check_gradients and scaler is None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.flags is None or self.flags.device != pl_module.device:
            self.flags = StepFlags(self.check_every_n_steps, pl_module.device)
        self.resume_checks_at(trainer.global_step)

    def begin_step(self, step: int) -> None:
        """Open the slot of optimizer step ``step`` (called at batch start and by replays)."""
        assert self.flags is not None
        self.flags.begin(step)
        self._loss_recorded = None
        self._grads_recorded = None

    def end_step(self, step: int, outputs: Any) -> None:
        """Record the loss of ``step`` from the training-step outputs (once per step; later calls are no-ops)."""
        if self._loss_recorded == step:
            return
        self._loss_recorded = step
        if self._handler is not None and self._handler.skips(step):
            return  # a skipped step's update is dropped: its (known bad) values are not a new failure
        loss = step_loss(outputs)
        if self.check_loss and loss is not None and self.flags is not None:
            self.flags.record_loss(step, loss)
        # manual optimisation (e.g. a CUDA-graphed step) never calls on_before_optimizer_step:
        # a "grad_norm" tensor in the outputs stands in for the gradients
        grad_norm = step_grad_norm(outputs)
        if self._grad_checks_enabled and self._grads_recorded != step and grad_norm is not None:
            assert self.flags is not None
            self.flags.record_grad_norm(step, grad_norm)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.begin_step(trainer.global_step)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._handler is not None and self._handler.skips(trainer.global_step):
            return
        if self._grad_checks_enabled and self.flags is not None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            self.flags.record_grads(trainer.global_step, grads)
            self._grads_recorded = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step already counts this step, so the step just computed is global_step - 1
        self.end_step(trainer.global_step - 1, outputs)
        if self._handler is not None:
            return  # the rollback callback polls and decides
        verdict = self.poll(trainer, pl_module)
        if verdict is None:
            return
        if not verdict.healthy:
            self._act(trainer, verdict)
        self.log_check(pl_module)

    # ---------------------------------------------------------------- checks
    def _check_due(self, trainer: pl.Trainer) -> bool:
        end = trainer.global_step
        if end - self._next_unchecked >= self.check_every_n_steps:
            return True
        if is_last_batch(trainer):
            return True
        return trainer.max_steps >= 0 and end >= trainer.max_steps

    def poll(self, trainer: pl.Trainer, pl_module: pl.LightningModule, force: bool = False) -> HealthVerdict | None:
        """The verdict for the steps since the last check, when a check is due (or ``force``); else None.

        Idempotent within a step: the first caller reads, later callers get the cached verdict.
        """
        end = trainer.global_step
        if self._cache is not None and self._cache[0] == end:
            return self._cache[1]
        if end <= self._next_unchecked or not (force or self._check_due(trainer)):
            return None
        verdict = self.check_steps(trainer, pl_module, self._next_unchecked, end)
        self._cache = (end, verdict)
        return verdict

    def check_steps(self, trainer: pl.Trainer, pl_module: pl.LightningModule, first: int, end: int) -> HealthVerdict:
        """Read steps ``[first, end)`` (one host transfer), test the parameters, run the spike detector."""
        assert self.flags is not None
        steps = list(range(first, end))
        param_norm = self.flags.record_params(end - 1, (p for p in pl_module.parameters() if p.requires_grad))
        records, extra = self.flags.read(steps, extra=param_norm)
        verdict = HealthVerdict(first, end, healthy=True, records=records)
        for record in records:
            reason = record.reason
            if reason is None and self.spike_detector is not None and record.loss is not None:
                if self.spike_detector.update(record.step, record.loss):
                    reason = HealthReason.LOSS_SPIKE
                    verdict.details = {"loss": record.loss, "z": self.spike_detector.last_z}
            if reason is not None:
                verdict.healthy = False
                verdict.reason = reason
                start = None
                if reason == HealthReason.LOSS_SPIKE and self.spike_detector is not None:
                    start = self.spike_detector.spike_start
                verdict.bad_step = start if start is not None else record.step
                if reason != HealthReason.LOSS_SPIKE:
                    verdict.details = {"loss": record.loss, "grad_norm": record.grad_norm}
                break
        verdict = agree_across_ranks(trainer, verdict)
        self._next_unchecked = end
        self.last_verdict = verdict
        if self.log_norms and records:
            metrics: dict[str, float] = {}
            if extra is not None:
                metrics["health/param_norm"] = float(extra[0])
            if self.spike_detector is not None and self.spike_detector.last_z is not None:
                metrics["health/loss_z"] = float(self.spike_detector.last_z)
            self._check_scalars = {name: value for name, value in metrics.items() if math.isfinite(value)}
        return verdict

    def log_check(self, pl_module: pl.LightningModule) -> None:
        """Log the check's scalars: ``health/events`` (events since the previous check), ``health/incidents``
        (failed checks so far) and the norms of the last :meth:`check_steps` (see :func:`log_check_scalars`).

        Called after a check has been acted on (by this callback, or by the attached rollback), in
        ``on_train_batch_end``, so the events of the check's own handling count at its step; the
        checks a rollback replays only update the norms logged here (a replay logs nothing).
        """
        metrics = {
            **self._check_scalars,
            "health/events": float(self.events.new_since_last_count()),
            "health/incidents": float(self.events.count(*INCIDENT_KINDS)),
        }
        self._check_scalars = {}
        log_check_scalars(pl_module.trainer, pl_module, metrics, prog_bar=("health/incidents",))

    def _act(self, trainer: pl.Trainer, verdict: HealthVerdict) -> None:
        action = self.on_spike if verdict.reason == HealthReason.LOSS_SPIKE else self.on_nonfinite
        assert verdict.bad_step is not None  # every unhealthy verdict names its step
        self.events.emit(
            trainer,
            EventKind.DETECTED,
            verdict.bad_step,
            announce=False,
            reason=verdict.reason,
            details=verdict.details,
        )
        message = f"NumericalHealthCallback: {verdict.describe()}"
        if action == "raise":
            raise NonFiniteError(message + ". HINT: add NaNRollbackCallback to roll back and recover.")
        if action == "stop":
            trainer.should_stop = True
        rank_zero_warn(message)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._handler is not None and self._handler.stopped:
            return
        maxima = parameter_max_abs(pl_module)
        if not maxima:
            return
        names, host = list(maxima), list(maxima.values())
        bad = [n for n, v in zip(names, host) if not math.isfinite(v)]
        worst = max(range(len(host)), key=lambda i: host[i] if math.isfinite(host[i]) else -1.0)
        if math.isfinite(host[worst]):
            log_epoch_scalar(trainer, pl_module, "health/param_max_abs", host[worst])
        if bad:
            verdict = HealthVerdict(
                trainer.global_step,
                trainer.global_step,
                False,
                trainer.global_step,
                HealthReason.NONFINITE_PARAM,
                details={"parameters": bad[:10]},
            )
            if self._handler is None:
                self._act(trainer, verdict)
        elif self.param_max_abs is not None and host[worst] > self.param_max_abs:
            self.events.emit(
                trainer,
                EventKind.LARGE_PARAM,
                trainer.global_step,
                announce=False,
                parameter=names[worst],
                max_abs=host[worst],
            )
            message = (
                f"parameter {names[worst]!r} has max |w| = {host[worst]:.4g} > param_max_abs={self.param_max_abs!r}"
            )
            if self.on_large_param == "raise":
                raise NonFiniteError(message)
            if self.on_large_param == "stop":
                trainer.should_stop = True
            rank_zero_warn(message)

    # ---------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "next_unchecked": self._next_unchecked,
            "spike": self.spike_detector.state_dict() if self.spike_detector is not None else None,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.spike_detector is not None and state_dict.get("spike") is not None:
            self.spike_detector.load_state_dict(state_dict["spike"])
        self.resume_checks_at(int(state_dict.get("next_unchecked", 0)))
