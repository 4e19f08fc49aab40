"""Health and rollback on DeepEP with ``cuda_graph=True``'s code path, run uncaptured on the CPU.

The graph path is manual optimisation: ``training_step`` runs ``GraphTraining.whole_step`` (rollout, loss,
backward, optimizer step) itself and hands ``{"loss", "grad_norm"}`` to the callbacks. Capture
needs CUDA, so here every step runs under ``uncaptured_steps()``: the same code without the
graph, on the same tensors. ``test_health_gpu.py`` runs the captured graph.
"""

import lightning.pytorch as pl
import pytest
import torch

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep.config import grouped
from deepep_lightning.deepep.graph_training import graph_capture_key
from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NonFiniteError, NumericalHealthCallback

from .conftest import OverflowBeforeStep, Recorder, fit, state_equal, tensor_addresses


class UncapturedGraphPath(DeepEPModule):
    """DeepEP's ``cuda_graph=True`` step with every step uncaptured and Adam not capturable (that needs CUDA)."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        for group in optimizer.param_groups:
            group["capturable"] = False
        return optimizer

    def training_step(self, batch, batch_idx):
        with self.uncaptured_steps():
            return super().training_step(batch, batch_idx)


def _make(**kwargs):
    return UncapturedGraphPath(
        **grouped(
            num_envs=4,
            rollout_length=8,
            hidden_size=16,
            steps_per_epoch=20,
            fused_value_head=False,
            cuda_graph=True,
            **kwargs,
        )
    )


def _kinds(health):
    return [(e["kind"], e["step"]) for e in health.events.events]


def test_module_is_on_the_manual_graph_path():
    module = _make()
    assert module.config.execution.cuda_graph and not module.automatic_optimization


def test_step_hands_loss_and_grad_norm_to_the_callbacks(tmp_path):
    recorder, health = Recorder(), NumericalHealthCallback(check_every_n_steps=2)
    fit(tmp_path, [health, recorder], max_steps=4, module=_make)
    assert all(set(out) == {"loss", "grad_norm"} for out in recorder.outputs)
    assert all(torch.isfinite(out["loss"]) and out["grad_norm"] > 0 for out in recorder.outputs)
    # the health callback read both: losses per step, and the grad norm standing in for the gradients
    records = health.last_verdict.records
    assert all(r.loss is not None for r in records) and records[-1].grad_norm > 0


def test_parameter_fault_detected_on_its_step(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=1)
    with pytest.raises(NonFiniteError, match="at step 5"):
        fit(tmp_path, [FaultInjectionCallback("parameter", steps=[5]), health], max_steps=8, module=_make)
    assert health.last_verdict.reason == "nonfinite_loss" and health.last_verdict.bad_step == 5


def test_without_rollback_the_nan_reaches_the_weights(tmp_path):
    """Negative control: on the manual path the planted NaN really goes through the update."""
    health = NumericalHealthCallback(check_every_n_steps=1, on_nonfinite="warn")
    with pytest.warns(UserWarning, match="at step 5"):
        _, module = fit(tmp_path, [FaultInjectionCallback("parameter", steps=[5]), health], max_steps=8, module=_make)
    assert all(not torch.isfinite(p).all() for p in module.parameters())


def test_transient_fault_rolled_back_in_place_and_bitwise(tmp_path):
    recorder = Recorder()
    _, clean = fit(
        tmp_path,
        [NumericalHealthCallback(check_every_n_steps=2), NaNRollbackCallback(snapshot_every_n_steps=4)],
        max_steps=10,
        module=_make,
    )
    health = NumericalHealthCallback(check_every_n_steps=2)
    callbacks = [
        FaultInjectionCallback("parameter", steps=[5]),
        health,
        NaNRollbackCallback(snapshot_every_n_steps=4),
        recorder,
    ]
    trainer, faulty = fit(tmp_path, callbacks, max_steps=10, module=_make)
    assert _kinds(health) == [("detected", 5), ("rollback", 4), ("transient", 5)]
    assert state_equal(clean.state_dict(), faulty.state_dict())
    a, b = clean.rollout_state_dict(), faulty.rollout_state_dict()
    assert a["rollout_step"] == b["rollout_step"] == 10 and torch.equal(a["hidden"], b["hidden"])
    # every parameter and optimizer-state tensor is still the one a captured graph would point to
    assert recorder.first == recorder.last and len(recorder.first) == 4 * len(list(faulty.parameters()))
    assert torch.isfinite(recorder.outputs[-1]["loss"])


class SkipProbe(pl.Callback):
    """Marks step ``step`` skipped and compares the update state around it."""

    def __init__(self, rollback, step):
        self.rollback, self.step, self.checks = rollback, step, {}

    def _state(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        tensors = list(pl_module.parameters()) + [
            v for p in pl_module.parameters() for v in optimizer.state[p].values()
        ]
        hidden = pl_module.rollout_state.hidden.clone()
        return [t.detach().clone() for t in tensors], tensor_addresses(pl_module, optimizer), hidden

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 0:
            self.rollback.load_state_dict({**self.rollback.state_dict(), "skip_steps": [self.step]})
        if trainer.global_step in (self.step - 1, self.step):
            self.before = self._state(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        if step in (self.step - 1, self.step):
            values, addresses, hidden = self._state(trainer, pl_module)
            unchanged = all(torch.equal(a, b) for a, b in zip(values, self.before[0]))
            self.checks[step] = (
                unchanged,
                addresses == self.before[1],
                not torch.equal(hidden, self.before[2]),
                outputs,
            )


def test_skipped_step_update_is_undone_in_place(tmp_path):
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip")
    probe = SkipProbe(rollback, step=3)
    trainer, _ = fit(
        tmp_path, [NumericalHealthCallback(check_every_n_steps=1), rollback, probe], max_steps=6, module=_make
    )
    unchanged, in_place, rollout_moved, outputs = probe.checks[3]
    # data position advances, update dropped; the step's outputs are returned as they are (never None: DDP)
    assert unchanged and in_place and rollout_moved and "loss" in outputs
    assert trainer.global_step == 6
    # negative control: the step before it did update (the probe can see an update)
    assert not probe.checks[2][0] and probe.checks[2][1]


def test_persistent_loss_fault_skipped_and_recovered(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip")
    trainer, module = fit(
        tmp_path,
        [FaultInjectionCallback("loss", steps=[6], mode="always"), health, rollback],
        max_steps=10,
        module=_make,
    )
    kinds = [k for k, _ in _kinds(health)]
    assert kinds == ["detected", "rollback", "reproducible", "diagnosis", "policy", "rollback", "recovered"]
    assert trainer.global_step == 10 and module.rollout_state_dict()["rollout_step"] == 10
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_diagnosis_names_the_overflowing_op_like_the_eager_path(tmp_path):
    found = {}
    for name, make in (
        (
            "eager",
            lambda: DeepEPModule(
                **grouped(num_envs=4, rollout_length=8, hidden_size=16, steps_per_epoch=20, fused_value_head=False)
            ),
        ),
        ("graph", _make),
    ):
        health = NumericalHealthCallback(check_every_n_steps=1)
        rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="stop")
        _, module = fit(tmp_path / name, [OverflowBeforeStep(6), health, rollback], max_steps=10, module=make)
        assert _kinds(health)[:1] == [("detected", 6)] and rollback.stopped
        assert all(torch.isfinite(p).all() for p in module.parameters())
        found[name] = next(e for e in health.events.events if e["kind"] == "diagnosis")
    assert found["graph"]["op"] == found["eager"]["op"] == "aten.pow.Tensor_Scalar"
    assert "loss.py" in found["graph"]["report"] and "value_loss" in found["graph"]["report"]


def test_lower_lr_changes_what_the_graph_is_captured_with(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="lower_lr", lr_factor=0.5, max_retries=1)
    trainer, module = fit(
        tmp_path,
        [FaultInjectionCallback("loss", steps=[6], mode="always"), health, rollback],
        max_steps=10,
        module=_make,
    )
    optimizer = trainer.optimizers[0]
    assert rollback.stopped and rollback.stop_report["lr_scale"] == 0.5
    assert [g["lr"] for g in optimizer.param_groups] == [
        module.config.optim.learning_rate * 0.5,
        module.config.optim.policy_learning_rate * 0.5,
    ]
    key = graph_capture_key(optimizer)
    assert graph_capture_key(optimizer) == key  # unchanged lr: the graph is kept
    optimizer.param_groups[0]["lr"] *= 0.5
    assert graph_capture_key(optimizer) != key  # changed lr: captured again at the next step


def test_gradient_fault_is_refused_where_no_backward_hook_runs(tmp_path):
    with pytest.raises(RuntimeError, match="target='parameter'"):
        fit(tmp_path, [FaultInjectionCallback("gradient", steps=[2])], max_steps=4, module=_make)
