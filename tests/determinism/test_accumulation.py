"""Tests for ``deepep_lightning/determinism/accumulation.py`` and DeterminismCallback's accumulation windows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepep_lightning.determinism import DeterminismCallback
from deepep_lightning.determinism.accumulation import capture_gradients, restore_gradients


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


def _checkpoint_state(callback: DeterminismCallback, trainer: SimpleNamespace, model: torch.nn.Module) -> dict:
    state: dict = {}
    callback._save_window_gradients(trainer, model, state)  # type: ignore[arg-type]
    return state


def test_window_gradients_are_saved_per_process_and_only_where_every_rank_keeps_its_state() -> None:
    model = _model_with_gradients()
    callback = DeterminismCallback(0)
    single = SimpleNamespace(world_size=1, strategy=SimpleNamespace())
    assert set(_checkpoint_state(callback, single, model)["accumulated_gradients"]) == {
        "0.weight",
        "0.bias",
        "1.weight",
    }
    per_rank = SimpleNamespace(world_size=2, strategy=SimpleNamespace(per_rank_checkpoint_keys=("callbacks",)))
    assert "accumulated_gradients" in _checkpoint_state(callback, per_rank, model)
    rank_zero_only = SimpleNamespace(world_size=2, strategy=SimpleNamespace())
    with pytest.warns(UserWarning, match="accumulation window holds no gradients with 2 processes"):
        assert _checkpoint_state(callback, rank_zero_only, model) == {}


def test_the_window_is_open_between_a_backward_and_the_optimizer_step(boring_module, quiet_trainer) -> None:
    """accumulate_grad_batches=3 over 8 batches: the window is open after batches 1, 2, 4, 5 and 7 (1-based)."""
    import lightning.pytorch as pl

    callback = DeterminismCallback(0, log_fingerprint=False)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.open: list[bool] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.open.append(callback._window_open)

    record = Record()
    quiet_trainer(max_epochs=1, accumulate_grad_batches=3, callbacks=[callback, record]).fit(boring_module())
    assert record.open == [True, True, False, True, True, False, True, False]
