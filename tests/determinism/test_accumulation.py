"""Tests for ``deepep_lightning/determinism/accumulation.py`` and DeterminismCallback's accumulation windows."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from deepep_lightning.determinism import DeterminismCallback
from deepep_lightning.determinism.accumulation import capture_gradients, restore_gradients, window_gradients


def _model_with_gradients() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1, bias=False))
    model(torch.randn(4, 3)).sum().backward()
    return model


def test_gradients_round_trip_bitwise_and_are_copies() -> None:
    model = _model_with_gradients()
    saved = capture_gradients(model)
    assert set(saved) == {"0.weight", "0.bias", "1.weight"}
    assert all(gradient.device.type == "cpu" for gradient in saved.values())
    expected = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    assert restore_gradients(model, saved) == []
    assert all(torch.equal(parameter.grad, expected[name]) for name, parameter in model.named_parameters())
    saved["0.bias"].add_(1.0)  # negative control: the restored gradients do not alias the saved ones
    assert torch.equal(model[0].bias.grad, expected["0.bias"])


def test_parameters_without_gradients_are_left_out_and_unknown_names_reported() -> None:
    model = torch.nn.Linear(2, 2)
    assert capture_gradients(model) == {}
    assert restore_gradients(model, {"other.weight": torch.zeros(1)}) == ["other.weight"]
    assert model.weight.grad is None


def test_a_gradient_of_another_shape_is_refused_naming_the_parameter() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"'weight' has shape \(3,\)"):
        restore_gradients(model, {"weight": torch.zeros(3)})


def test_window_gradients_are_kept_per_process_and_only_where_every_rank_keeps_its_state() -> None:
    model = _model_with_gradients()
    single = SimpleNamespace(world_size=1, strategy=SimpleNamespace())
    assert set(window_gradients(single, model) or {}) == {"0.weight", "0.bias", "1.weight"}
    per_rank = SimpleNamespace(world_size=2, strategy=SimpleNamespace(per_rank_checkpoint_keys=("callbacks",)))
    assert window_gradients(per_rank, model) is not None
    rank_zero_only = SimpleNamespace(world_size=2, strategy=SimpleNamespace())
    assert window_gradients(rank_zero_only, model) is None


def test_a_checkpoint_in_a_window_that_cannot_keep_gradients_warns_once(
    boring_module, quiet_trainer, monkeypatch
) -> None:
    """The callback's own checkpoint hook, on a trainer that reports 2 processes and keeps rank 0's state only."""
    import lightning.pytorch as pl

    callback = DeterminismCallback(0, log_fingerprint=False)
    model = boring_module()
    trainer = quiet_trainer(max_steps=1, callbacks=[callback])
    trainer.fit(model)

    def checkpoint() -> dict:
        state = {"callbacks": {callback.state_key: callback.state_dict()}, "state_dict": model.state_dict()}
        callback.on_save_checkpoint(trainer, model, state)
        return state["callbacks"][callback.state_key]

    callback.on_after_backward(trainer, model)  # a window is open
    assert callback.window_open and "accumulated_gradients" in checkpoint()  # one process: kept
    monkeypatch.setattr(pl.Trainer, "world_size", property(lambda self: 2))
    with pytest.warns(UserWarning, match="accumulation window holds no gradients with 2 processes"):
        assert "accumulated_gradients" not in checkpoint()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint()  # said once
    assert not [w for w in caught if "accumulation window" in str(w.message)]
    callback.on_before_optimizer_step(trainer, model, trainer.optimizers[0])
    assert not callback.window_open
    checkpoint()  # negative control: no window, nothing to warn about


def test_the_window_is_open_between_a_backward_and_the_optimizer_step(boring_module, quiet_trainer) -> None:
    """accumulate_grad_batches=3 over 8 batches: the window is open after batches 1, 2, 4, 5 and 7 (1-based)."""
    import lightning.pytorch as pl

    callback = DeterminismCallback(0, log_fingerprint=False)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.open: list[bool] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.open.append(callback.window_open)

    record = Record()
    quiet_trainer(max_epochs=1, accumulate_grad_batches=3, callbacks=[callback, record]).fit(boring_module())
    assert record.open == [True, True, False, True, True, False, True, False]
