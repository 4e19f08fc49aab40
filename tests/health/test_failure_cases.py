"""Failure cases that no other test file states on its own.

docs/survivability.md maps every failure case to the test that proves its behaviour; the cases
covered elsewhere are named there. Here: the diagnosis names a module by its path also when the module is
called from ``training_step``, an optimizer-step NaN is not reported as "no op", a world-size change that
the strategy accepts is named by ``DeterminismCallback``, ``bucket_cap_mb`` is finite, and DeepEP's
rates, scales and switches refuse infinity and truthy strings.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from deepep_lightning import NaNRollbackCallback, NumericalHealthCallback
from deepep_lightning.determinism import DeterminismCallback
from deepep_lightning.determinism.resume_checks import FingerprintMismatchError
from deepep_lightning.strategies import DeterministicDDPStrategy

from .conftest import ToyModule, fit
from .test_rollback import _blow_up_module

MAX_STEPS = 10
PLANTED_STEP = 6
NO_OP_REPORT = "no op of the step (forward, backward, optimizer step) produced a non-finite value"


class _Gate(nn.Module):
    """Multiplies by a learned gate; at the armed step its forward (log of zero) or backward (d sqrt(0)) is inf."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)
        self.plant: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.plant == "forward":
            return torch.log(y * 0)
        if self.plant == "backward":
            return torch.sqrt(y * 0) + y
        return y


class _Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = _Gate()


class GatedModule(ToyModule):
    """``scorer.gate`` is called from ``training_step``, never through a ``forward`` of its parents."""

    def __init__(self, plant: str) -> None:
        super().__init__()
        self.scorer = _Scorer()
        self._planted_kind = plant

    def training_step(self, batch, batch_idx):
        x, y = batch
        armed = self.trainer.global_step == PLANTED_STEP  # in replays and the diagnosis too: reproducible
        self.scorer.gate.plant = self._planted_kind if armed else None
        loss = nn.functional.mse_loss(self.scorer.gate(self.inner(x)), y)
        self.log("train/loss", loss)
        return loss


def _diagnosis(health: NumericalHealthCallback) -> dict:
    return next(e for e in health.events.events if e["kind"] == "diagnosis")


@pytest.mark.parametrize("plant", ["forward", "backward"])
def test_a_nan_in_a_module_called_from_training_step_is_diagnosed_by_its_path(tmp_path, plant):
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip")
    with pytest.warns(UserWarning, match=f"diagnosis at step {PLANTED_STEP}") as caught:
        _, module = fit(tmp_path, [health, rollback], max_steps=MAX_STEPS, module=lambda: GatedModule(plant))
    diagnosis = _diagnosis(health)
    assert diagnosis["phase"] == plant and diagnosis["module"] == "scorer.gate"
    assert "scorer.gate" in diagnosis["report"] and "_Gate" not in diagnosis["report"]  # a path, not the class
    assert not any(NO_OP_REPORT in str(w.message) for w in caught)
    assert rollback.state_dict()["skip_steps"] == [PLANTED_STEP]
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_an_optimizer_step_nan_is_named_and_never_reported_as_no_op(tmp_path):
    """The update of ``optimizer.step()`` makes the Inf: the report names optimizer and parameter, once."""
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip", skip_batches=1)
    with pytest.warns(UserWarning) as caught:
        fit(tmp_path, [health, rollback], max_steps=MAX_STEPS, module=_blow_up_module(5))
    diagnoses = [e for e in health.events.events if e["kind"] == "diagnosis"]
    assert len(diagnoses) == 1 and diagnoses[0]["phase"] == "optimizer"
    assert "optimizer: BlowUpAdam (optimizer 0), parameter: inner.3.weight" in diagnoses[0]["report"]
    assert not any(NO_OP_REPORT in str(w.message) for w in caught)


def test_negative_control_without_the_update_locator_the_same_nan_is_reported_as_no_op(tmp_path, monkeypatch):
    """The diagnosis without its optimizer-step locator: the forward and backward are finite, so "no op"."""
    from deepep_lightning.health import _replay

    monkeypatch.setattr(_replay, "locate_nonfinite_update", lambda *args, **kwargs: None)
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip", skip_batches=1)
    with pytest.warns(UserWarning, match="diagnosis at step 5"):
        fit(tmp_path, [health, rollback], max_steps=MAX_STEPS, module=_blow_up_module(5))
    diagnosis = _diagnosis(health)
    assert diagnosis["report"].startswith(NO_OP_REPORT) and diagnosis["phase"] is None


def test_a_world_size_change_the_strategy_accepts_is_named_by_the_determinism_callback():
    """``allow_world_size_change=True`` lets the strategy resume; the callback's fingerprint names the field."""
    saved = DeterminismCallback(3).state_dict()
    assert saved["fingerprint"]["world_size"] == "1"
    DeterminismCallback(3).load_state_dict(saved)  # negative control: the same world size loads silently
    saved["fingerprint"]["world_size"] = "2"
    with pytest.raises(FingerprintMismatchError, match=r"Fields that differ: .*world_size: '2' -> '1'"):
        DeterminismCallback(3).load_state_dict(saved)
    with pytest.warns(UserWarning, match=r"world_size: '2' -> '1'"):
        DeterminismCallback(3, strict=False).load_state_dict(saved)


def test_a_snapshot_of_another_run_in_the_shared_directory_is_never_restored(tmp_path):
    """Two runs share ``snapshot_dir``: a file of run B where run A's newest was is refused, A's older one used."""
    import os
    import shutil

    from deepep_lightning.health.snapshot import Snapshot, SnapshotRing

    trainer, module = fit(tmp_path / "fit", [NumericalHealthCallback()], max_steps=3)
    rings = {name: SnapshotRing(keep=2, directory=str(tmp_path / "shared"), run_id=name) for name in ("run-a", "run-b")}
    for ring in rings.values():
        for step in (10, 20):
            snapshot = Snapshot.capture(trainer, module, {}, 1.0)
            snapshot.step = step
            ring.push(snapshot)
    newest_a, newest_b = rings["run-a"].files()[-1], rings["run-b"].files()[-1]
    assert newest_a != newest_b  # the run id is in the name: the runs never overwrite each other
    assert rings["run-a"].latest().step == 20  # negative control: its own newest file loads
    shutil.copy(newest_b, newest_a)  # e.g. copied back from another run's directory
    refused = []
    assert rings["run-a"].latest(on_corrupt=lambda path, error: refused.append(str(error))).step == 10
    assert refused and "written by run 'run-b', not by this run ('run-a')" in refused[0]
    assert not os.path.exists(newest_a) and os.path.exists(newest_b)  # only the refused copy is deleted


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_bucket_cap_mb_must_be_a_finite_number(value):
    with pytest.raises(MisconfigurationException, match=r"bucket_cap_mb.*a finite number > 0") as info:
        DeterministicDDPStrategy(bucket_cap_mb=value)
    assert repr(value) in str(info.value)
    DeterministicDDPStrategy(bucket_cap_mb=25.0)  # negative control: a finite size is accepted


@pytest.mark.parametrize(
    "kwargs",
    [
        {"learning_rate": math.inf},
        {"policy_learning_rate": math.inf},
        {"reward_scale": math.inf},
        {"value_coef": math.inf},
        {"cuda_graph": "false"},
    ],
    ids=["learning_rate", "policy_learning_rate", "reward_scale", "value_coef", "cuda_graph"],
)
def test_deepep_refuses_infinite_rates_and_scales_and_truthy_strings(kwargs):
    from deepep_lightning.deepep import DeepEPModule
    from deepep_lightning.deepep.config import grouped

    name, value = next(iter(kwargs.items()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(MisconfigurationException, match=name) as info:
            DeepEPModule(**grouped(**kwargs))
        DeepEPModule(
            **grouped(**{name: False if name == "cuda_graph" else 0.5})
        )  # negative control: a valid value passes
    assert repr(value) in str(info.value)
