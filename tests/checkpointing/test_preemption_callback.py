"""PreemptionCallback in this process: arguments, handler install and restore, the step boundary, SLURM.

The real-process, real-scheduler-signal runs (exit codes, bitwise resume, two ranks) are in
``test_preemption.py``; here a signal sent to this process during ``fit`` ends ``fit`` with
``SystemExit(128 + signum)``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.checkpointing import AtomicCheckpointIO, PreemptionCallback, exit_code_for


class _SignalAt(Callback):
    """Sends this process ``signum`` at the start of batch ``batch``; records the handlers seen in training."""

    def __init__(self, signum: int, batch: int) -> None:
        self.signum, self.batch = signum, batch
        self.handlers: dict[int, object] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.batch:
            self.handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize(
    "kwargs, shown",
    [
        ({"signals": "SIGTERM"}, "'SIGTERM'"),
        ({"signals": []}, "[]"),
        ({"signals": ["SIGKILL"]}, "'SIGKILL'"),
        ({"signals": ["SIGNOPE"]}, "'SIGNOPE'"),
        ({"check_every_n_steps": 0}, "0"),
        ({"checkpoint_path": 3}, "3"),
        ({"atomic_checkpoints": "yes"}, "'yes'"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, shown: str) -> None:
    name = next(iter(kwargs))
    with pytest.raises(MisconfigurationException, match=name) as raised:
        PreemptionCallback(**kwargs)
    assert shown in str(raised.value)


def test_signals_by_name_or_number_and_exit_codes() -> None:
    callback = PreemptionCallback(signals=["SIGTERM", int(signal.SIGUSR2), "SIGTERM"])
    assert callback.signals == (signal.SIGTERM, signal.SIGUSR2)
    assert [exit_code_for(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)] == [143, 138, 130]


def test_a_signal_mid_window_is_acted_on_at_the_optimizer_step_and_handlers_are_restored(
    tmp_path: Path, quiet_trainer, boring_module
) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    preemption = PreemptionCallback(checkpoint_path=tmp_path / "preempted.ckpt")
    sender = _SignalAt(signal.SIGUSR1, batch=4)  # the first batch of the window of step 3 (2 batches a step)
    trainer = quiet_trainer(max_steps=8, accumulate_grad_batches=2, callbacks=[preemption, sender])
    with pytest.raises(SystemExit) as raised:
        trainer.fit(boring_module())
    assert raised.value.code == 138
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    checkpoint = torch.load(tmp_path / "preempted.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 3  # the window was finished, not cut
    assert all(sender.handlers[s] == preemption._handle for s in before)  # ours during training
    assert {s: signal.getsignal(s) for s in before} == before  # and the previous ones afterwards


def test_no_signal_no_checkpoint_and_handlers_restored(tmp_path: Path, quiet_trainer, boring_module) -> None:
    before = signal.getsignal(signal.SIGTERM)
    trainer = quiet_trainer(max_steps=3, callbacks=[PreemptionCallback(checkpoint_path=tmp_path / "p.ckpt")])
    trainer.fit(boring_module())
    assert trainer.global_step == 3 and not (tmp_path / "p.ckpt").exists()
    assert signal.getsignal(signal.SIGTERM) == before


def test_slurm_auto_requeue_keeps_lightnings_requeue_signal(tmp_path: Path, quiet_trainer, boring_module) -> None:
    preemption = PreemptionCallback(checkpoint_path=tmp_path / "p.ckpt")
    sender = _SignalAt(signal.SIGTERM, batch=1)
    trainer = quiet_trainer(max_steps=4, plugins=[SLURMEnvironment(auto_requeue=True)], callbacks=[preemption, sender])
    with pytest.raises(SystemExit) as raised:
        trainer.fit(boring_module())
    assert raised.value.code == 143 and torch.load(tmp_path / "p.ckpt", weights_only=False)["global_step"] == 2
    assert sender.handlers[signal.SIGTERM] == preemption._handle
    assert sender.handlers[signal.SIGUSR1] != preemption._handle  # Lightning's: it saves and requeues


def test_default_path_is_model_checkpoints_last_and_ckpt_path_last_resumes_from_it(
    tmp_path: Path, quiet_trainer, boring_module
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(*callbacks: Callback):
        periodic = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_last=True)
        return quiet_trainer(max_steps=10, enable_checkpointing=True, callbacks=[periodic, *callbacks])

    preempted = trainer(PreemptionCallback(), _SignalAt(signal.SIGTERM, batch=5))
    with pytest.raises(SystemExit) as raised:
        preempted.fit(boring_module())
    assert raised.value.code == 143
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 6  # the periodic one said 4
    resumed, module = trainer(), boring_module()
    resumed.fit(module, ckpt_path="last")
    assert resumed.ckpt_path == str(tmp_path / "last.ckpt") and resumed.global_step == 10
    assert len(module.losses) == 4  # steps 7 to 10: nothing after step 6 was repeated
