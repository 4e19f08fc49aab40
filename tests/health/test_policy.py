"""AppliedPolicy: which steps the skip policy dropped, the LR scale, and their checkpointed form."""

from types import SimpleNamespace

import pytest
import torch

from deepep_lightning.health.policy import AppliedPolicy


def test_skip_records_the_steps_and_stops_at_the_cap():
    applied = AppliedPolicy("skip", skip_batches=2, lr_factor=0.5, max_skipped_steps=3)
    assert applied.apply(7) == {"policy": "skip", "skipped_steps": [7, 8]}
    assert applied.skips(8) and not applied.skips(9)
    assert not applied.skip_cap_reached(8)  # 7, 8, 9: three steps
    assert applied.skip_cap_reached(10)  # 7, 8, 10, 11: past the cap


def test_lower_lr_scales_restored_learning_rates_by_the_ratio():
    applied = AppliedPolicy("lower_lr", skip_batches=1, lr_factor=0.5, max_skipped_steps=1)
    assert applied.apply(3) == {"policy": "lower_lr", "lr_scale": 0.5}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    trainer = SimpleNamespace(optimizers=[optimizer], lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])
    applied.scale_learning_rates(trainer, restored_scale=1.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05) and scheduler.base_lrs == [pytest.approx(0.05)]
    applied.scale_learning_rates(trainer, restored_scale=0.5)  # already at the scale: unchanged
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_state_round_trip_and_defaults_for_missing_keys():
    applied = AppliedPolicy("skip", skip_batches=1, lr_factor=0.5, max_skipped_steps=10)
    applied.load_state_dict({"skip_steps": [4, 2], "lr_scale": 0.25})
    assert applied.state_dict() == {"skip_steps": [2, 4], "lr_scale": 0.25}
    applied.load_state_dict({})
    assert applied.state_dict() == {"skip_steps": [], "lr_scale": 1.0}
