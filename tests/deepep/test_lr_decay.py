"""DeepEPModule's stepwise learning-rate decay (deepep/lr_decay.py): the stairs, in a Trainer fit, resumed from a
checkpoint, outside a Trainer, composed with lower_lr's scaling, and its argument checks."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep.config import grouped
from deepep_lightning.deepep.graph_training import StandaloneStep
from deepep_lightning.deepep.lr_decay import lr_decay_factor, lr_stairs

TINY = dict(num_envs=4, rollout_length=4, hidden_size=8, steps_per_epoch=4, fused_value_head=False, seed=1)
STAIRS = [1.0, 1.0, 0.75, 0.75, 0.5, 0.5, 0.25, 0.25]  # 8 steps, 4 stages


class _RecordLRs(pl.Callback):
    """The learning rates each optimizer step uses (the scheduler sets the next step's after the step)."""

    def __init__(self) -> None:
        self.lrs: list[list[float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append([group["lr"] for group in optimizer.param_groups])


def _fit(tmp_path, max_steps, ckpt_path=None, checkpoint_every=None, **kwargs):
    recorder = _RecordLRs()
    callbacks = [recorder]
    if checkpoint_every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=checkpoint_every, save_top_k=-1)
        )
    model = DeepEPModule(**grouped(**{**TINY, **kwargs}))
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=bool(checkpoint_every),
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, recorder.lrs


def test_the_factor_falls_in_equal_stairs_and_stays_on_the_last():
    assert [lr_decay_factor(step, 8, 4) for step in range(10)] == [*STAIRS, 0.25, 0.25]
    assert {lr_decay_factor(step, 8, 1) for step in range(20)} == {1.0}  # one stage: constant
    assert [lr_decay_factor(step, 4, 4) for step in range(4)] == [1.0, 0.75, 0.5, 0.25]  # a stair per step


def test_a_fit_steps_every_group_down_the_stairs(tmp_path):
    _, lrs = _fit(tmp_path, 8, lr_decay_steps=8, lr_decay_stages=4, learning_rate=2e-3, policy_learning_rate=1e-4)
    assert lrs == [[2e-3 * f, 1e-4 * f] for f in STAIRS]
    _, constant = _fit(tmp_path, 8, learning_rate=2e-3, policy_learning_rate=1e-4)  # negative control
    assert constant == [[2e-3, 1e-4]] * 8


def test_a_resumed_fit_continues_the_stairs_bitwise(tmp_path):
    decay = dict(lr_decay_steps=8, lr_decay_stages=4)
    whole, whole_lrs = _fit(tmp_path / "whole", 8, **decay)
    _fit(tmp_path / "first", 4, checkpoint_every=4, **decay)
    resumed, resumed_lrs = _fit(
        tmp_path / "rest", 8, ckpt_path=str(tmp_path / "first" / "epoch=0-step=4.ckpt"), **decay
    )
    assert resumed_lrs == whole_lrs[4:]
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))
    undecayed, _ = _fit(tmp_path / "plain", 8)  # negative control: the decay changes the weights
    assert any(not torch.equal(a, b) for a, b in zip(whole.state_dict().values(), undecayed.state_dict().values()))


def test_outside_a_trainer_the_standalone_step_decays_too():
    model = DeepEPModule(**grouped(**TINY, lr_decay_steps=8, lr_decay_stages=4))
    step = StandaloneStep(model, model.configure_optimizers())
    base = step.optimizer.param_groups[0]["lr"]
    seen = []
    for _ in range(8):  # the rate each step uses
        seen.append(step.optimizer.param_groups[0]["lr"] / base)
        step()
    assert seen == pytest.approx(STAIRS, rel=1e-12)


def test_a_scaled_base_lr_carries_into_the_next_stair():
    """NaNRollbackCallback's lower_lr multiplies lr and the scheduler's base_lrs; the decay applies on top."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = lr_stairs(optimizer, 8, 4)
    group = optimizer.param_groups[0]
    group["lr"], scheduler.base_lrs = group["lr"] * 0.5, [lr * 0.5 for lr in scheduler.base_lrs]  # what lower_lr does
    optimizer.step()
    scheduler.step()
    optimizer.step()
    scheduler.step()
    assert group["lr"] == 0.5 * 0.75 and scheduler.base_lrs == [0.5]


def test_the_stairs_are_a_scheduler_of_the_configured_optimizer():
    configured = DeepEPModule(**grouped(**TINY, lr_decay_steps=8, lr_decay_stages=4)).configure_optimizers()
    assert isinstance(configured["lr_scheduler"]["scheduler"], torch.optim.lr_scheduler.LambdaLR)
    assert configured["lr_scheduler"]["interval"] == "step"
    assert isinstance(
        DeepEPModule(**grouped(**TINY)).configure_optimizers(), torch.optim.Adam
    )  # constant rates: no scheduler


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr_decay_steps": 0}, r"lr_decay_steps=.*must be a positive int or None, got 0"),
        ({"lr_decay_steps": True}, r"lr_decay_steps=.*got True"),
        ({"lr_decay_steps": 2.5}, r"lr_decay_steps=.*got 2.5"),
        ({"lr_decay_steps": 10, "lr_decay_stages": 0}, r"lr_decay_stages.*0"),
        ({"lr_decay_steps": 10, "lr_decay_stages": "4"}, r"lr_decay_stages.*'4'"),
    ],
)
def test_bad_decay_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(MisconfigurationException, match=match):
        DeepEPModule(**grouped(**TINY, **kwargs))
