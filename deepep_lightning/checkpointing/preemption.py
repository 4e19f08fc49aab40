"""PreemptionCallback: on SIGTERM, SIGUSR1 or SIGINT, checkpoint at the next optimizer step and exit non-zero.

A cluster scheduler sends SIGTERM (SLURM: SIGUSR1 first, with ``--signal``) before it kills a job.
Lightning's own SIGTERM handler stops the fit with exit code 0 and writes nothing, so the steps since
the last checkpoint are lost and a scheduler that requeues on a non-zero exit never requeues. This
callback, during ``fit``:

* replaces the handlers of ``signals`` from the sanity check (or ``on_train_start``), after Lightning
  installed its own, with one that only records the signal; a repeated SIGINT raises
  ``KeyboardInterrupt`` at once;
* at the end of every ``check_every_n_steps``-th optimizer step (``on_train_batch_end`` after a
  step, never inside an accumulation window) agrees across ranks with one ``max`` reduction of
  the signal numbers, so a signal that reached one rank stops every rank at the same step;
* then every rank takes part in ``trainer.save_checkpoint(checkpoint_path)`` (the full checkpoint:
  :class:`~deepep_lightning.DeterminismCallback`'s exact-resume state included) and raises
  ``SystemExit(128 + signal number)``: 143 for SIGTERM, 138 for SIGUSR1, 130 for SIGINT, the codes
  a shell reports for a process the signal ended, which schedulers requeue on;
* puts the previous handlers back at the end of training (and on any exception).

The save goes through :class:`~deepep_lightning.AtomicCheckpointIO`, which ``setup`` installs when
the strategy has Lightning's plain ``TorchCheckpointIO``: the checkpoint is complete or absent.

``checkpoint_path=None`` writes ``last.ckpt`` in ``ModelCheckpoint``'s directory, so
``trainer.fit(model, ckpt_path="last")`` resumes from it (the newest ``last*.ckpt`` there), losing no
step; without a ``ModelCheckpoint`` it writes ``<default_root_dir>/checkpoints/last.ckpt``.

Under ``SLURMEnvironment(auto_requeue=True)`` the environment's requeue signal stays Lightning's
(it saves its ``hpc_ckpt`` and calls ``scontrol requeue``): this callback leaves that signal alone
and handles the others.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from deepep_lightning import _checks, _lightning_compat
from deepep_lightning.checkpointing.checkpoint_io import AtomicCheckpointIO

__all__ = ["PreemptionCallback", "exit_code_for"]

log = logging.getLogger(__name__)

_DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
_LAST_NAME = ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION


def exit_code_for(signum: int) -> int:
    """The exit code of a run stopped by signal ``signum``: ``128 + signum`` (143 for SIGTERM)."""
    return 128 + int(signum)


def _signal_number(value: Any) -> signal.Signals:
    named = value
    if isinstance(value, str) and value.startswith("SIG") and "_" not in value:
        named = getattr(signal, value, None)
    try:
        number = signal.Signals(named)
    except (ValueError, TypeError):
        number = None
    if number is None or number in (signal.SIGKILL, signal.SIGSTOP):
        raise MisconfigurationException(
            f"`PreemptionCallback(signals=...)` must hold signal names or numbers that can be caught"
            f" (e.g. 'SIGTERM', 'SIGUSR2', {int(signal.SIGUSR2)}), got {value!r}"
        )
    return number


class PreemptionCallback(Callback):
    """Turn a preemption signal into a complete checkpoint at an optimizer-step boundary and a non-zero exit.

    Args:
        signals: the signals to handle (names or numbers); default SIGTERM, SIGUSR1 (SLURM's warning
            signal) and SIGINT. Add any other, e.g. ``("SIGTERM", "SIGUSR2")``.
        checkpoint_path: where the preemption checkpoint goes; ``None``: ``last.ckpt`` in
            ``ModelCheckpoint``'s directory (``ckpt_path="last"`` finds it), else in
            ``<default_root_dir>/checkpoints``.
        check_every_n_steps: look for a signal every this many optimizer steps (under DDP each look
            is one small all-reduce; a larger value saves it at the cost of up to that many steps
            of delay). The signal is acted on at the first look after it arrived.
        atomic_checkpoints: at ``setup``, replace Lightning's ``TorchCheckpointIO`` with
            :class:`~deepep_lightning.AtomicCheckpointIO` (a custom checkpoint IO is left as it is).

    Raises:
        MisconfigurationException: an argument has a wrong type or value.
        SystemExit: ``128 + signal number`` after the checkpoint is written (see :func:`exit_code_for`).

    Example::

        trainer = Trainer(callbacks=[DeterminismCallback(), ModelCheckpoint(every_n_train_steps=100),
                                     PreemptionCallback()])
        trainer.fit(model, ckpt_path="last")  # after a requeue: continues at the preempted step
    """

    def __init__(
        self,
        signals: Sequence[str | int] = _DEFAULT_SIGNALS,
        checkpoint_path: str | os.PathLike[str] | None = None,
        check_every_n_steps: int = 1,
        atomic_checkpoints: bool = True,
    ) -> None:
        if isinstance(signals, (str, bytes)) or not isinstance(signals, Sequence) or not signals:
            raise MisconfigurationException(
                f"`PreemptionCallback(signals=...)` must be a non-empty list of signal names or numbers,"
                f" got {signals!r}"
            )
        self.signals: tuple[signal.Signals, ...] = tuple(dict.fromkeys(_signal_number(s) for s in signals))
        path = _checks.path("PreemptionCallback", "checkpoint_path", checkpoint_path, allow_none=True)
        self.checkpoint_path = None if path is None else os.fspath(path)
        self.check_every_n_steps: int = _checks.int_in_range(
            "PreemptionCallback", "check_every_n_steps", check_every_n_steps, 1, 100_000
        )
        self.atomic_checkpoints = _checks.strict_bool("PreemptionCallback", "atomic_checkpoints", atomic_checkpoints)
        self.received: signal.Signals | None = None  # the first signal this process got during this fit
        self._previous: dict[signal.Signals, Any] = {}
        self._step_at_batch_start = 0

    # ---------------------------------------------------------------- handlers
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # only a flag (no I/O, no lock in a signal handler): the step finishes, every rank acts at one boundary
        number = signal.Signals(signum)
        if self.received is not None and number == signal.SIGINT:
            raise KeyboardInterrupt
        if self.received is None:
            self.received = number

    def _handled_signals(self, trainer: "pl.Trainer") -> list[signal.Signals]:
        environment = _lightning_compat.cluster_environment(trainer)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            requeue = environment.requeue_signal
            return [s for s in self.signals if s != requeue]  # Lightning saves and requeues on that one
        return list(self.signals)

    def _install(self, trainer: "pl.Trainer") -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("PreemptionCallback: not the main thread, no signal handler installed")
            return
        for number in self._handled_signals(trainer):
            if number not in self._previous:  # idempotent: the sanity check and the train start both install
                self._previous[number] = signal.signal(number, self._handle)

    def _restore(self) -> None:
        for number, previous in self._previous.items():
            if signal.getsignal(number) == self._handle:  # None: a handler not set from Python; the default
                signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    # ---------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.received = None
        if stage == "fit" and self.atomic_checkpoints and type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    @override
    def on_sanity_check_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._install(trainer)  # a signal during the sanity check is acted on after the first step

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._install(trainer)
        names = ", ".join(s.name for s in self._handled_signals(trainer))
        rank_zero_info(f"PreemptionCallback: on {names}, checkpoint to {self.resolved_path(trainer)!r} and exit")

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped = trainer.global_step != self._step_at_batch_start
        if not stepped or trainer.global_step % self.check_every_n_steps:
            return
        local = torch.tensor(int(self.received or 0), device=trainer.strategy.root_device)
        agreed = int(trainer.strategy.reduce(local, reduce_op="max"))  # every rank calls it at this step
        if agreed == 0:
            return
        name = signal.Signals(agreed).name
        path = self.resolved_path(trainer)
        rank_zero_info(
            f"PreemptionCallback: {name} received; saving step {trainer.global_step} to {path!r}, then exiting"
            f" with code {exit_code_for(agreed)}"
        )
        trainer.save_checkpoint(path)
        self._restore()
        raise SystemExit(exit_code_for(agreed))

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._restore()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._restore()

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._restore()

    def resolved_path(self, trainer: "pl.Trainer") -> str:
        """The file the preemption checkpoint is written to (see ``checkpoint_path``)."""
        if self.checkpoint_path is not None:
            return self.checkpoint_path
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            return os.path.join(os.fspath(callback.dirpath), _LAST_NAME)
        return os.path.join(trainer.default_root_dir, "checkpoints", _LAST_NAME)
