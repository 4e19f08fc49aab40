"""FaultInjectionCallback: argument checks, once vs always, each target really planted."""

import contextlib

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback

from .conftest import fit


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"target": "weights"}, "target"),
        ({"mode": "sometimes"}, "mode"),
        ({"value": "big"}, "value"),
        ({"steps": [-1]}, "steps"),
        ({"steps": 3}, "steps"),
        ({"steps": [1.5]}, "steps"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(MisconfigurationException, match=name) as info:
        FaultInjectionCallback(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_unknown_parameter_name(tmp_path):
    with pytest.raises(MisconfigurationException, match="nope"):
        fit(tmp_path, [FaultInjectionCallback("parameter", parameter="nope")], max_steps=2)


@pytest.mark.parametrize("mode, expected", [("once", 1), ("always", 2)])
def test_once_vs_always_under_replay(tmp_path, mode, expected):
    fault = FaultInjectionCallback("gradient", steps=[3], mode=mode)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=2, policy="stop")
    stops = pytest.warns(UserWarning, match="NaNRollbackCallback stopped training")  # "once" is transient
    with stops if mode == "always" else contextlib.nullcontext():
        fit(tmp_path, [fault, NumericalHealthCallback(check_every_n_steps=1), rollback], max_steps=6)
    # "always" fires again in the replay (and the locator does not backprop through Lightning hooks)
    assert [s for s, _ in fault.injections] == [3] * expected


def test_named_parameter_is_poisoned(tmp_path):
    fault = FaultInjectionCallback("parameter", steps=[1], parameter="inner.3.bias", value="inf")
    _, module = fit(tmp_path, [fault], max_steps=2)
    assert not torch.isfinite(module.inner[3].bias).all() and fault.injections == [(1, "parameter")]


def test_hooks_removed_after_fit(tmp_path):
    _, module = fit(tmp_path, [FaultInjectionCallback("loss", steps=[100])], max_steps=1)
    assert "training_step" not in module.__dict__


def test_state_key_and_checkpoint_round_trip(tmp_path):
    from .conftest import checkpoint_round_trip

    fault = FaultInjectionCallback("loss", steps=[1, 3], mode="once")
    trainer, _ = fit(tmp_path, [fault], max_steps=5)
    twin = FaultInjectionCallback("loss", steps=[3, 1], mode="once")  # the same steps in another order: same key
    assert checkpoint_round_trip(tmp_path, trainer, fault, twin) == {"fired": [1, 3]}
    assert FaultInjectionCallback("loss", steps=[1, 3], mode="always").state_key != fault.state_key
