"""GPU campaign: no host sync per step (sync debug mode), transient faults bitwise, persistent ones handled, DeepEP.

The ``test_graph_*`` tests run DeepEP with ``cuda_graph=True``: the whole step is one CUDA graph replay, and
rollback must restore in place what the graph points to.
"""

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from deepep_lightning.audit.nonfinite import locate_nonfinite
from deepep_lightning.deepep import DeepEPModule, graph_training
from deepep_lightning.deepep.config import grouped
from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback, state_copies
from deepep_lightning.health import snapshot as snapshot_module

from .conftest import OverflowBeforeStep, Recorder, ToyModule, fit, state_equal

pytestmark = pytest.mark.gpu


class CudaToy(ToyModule):
    """Data already on the GPU and no ``self.log``: the only syncs left would be ours."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.inner(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.n_samples, 4, generator=g)
        y = x.sum(dim=1, keepdim=True)
        return DataLoader(TensorDataset(x.cuda(), y.cuda()), batch_size=self.batch_size, shuffle=False)


class _Arm(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # the last step is left unarmed: reaching max_steps forces a final check (one read, by design)
        if trainer.global_step < trainer.max_steps - 1:
            torch.cuda.set_sync_debug_mode("error")


class _Disarm(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.set_sync_debug_mode(0)


def _gpu_fit(tmp_path, callbacks, max_steps, module=CudaToy):
    return fit(tmp_path, callbacks, max_steps=max_steps, module=module, accelerator="gpu")


def test_steps_between_checks_do_not_sync(tmp_path):
    callbacks = [
        _Arm(),
        NumericalHealthCallback(check_every_n_steps=1000, spike_detection=False),
        NaNRollbackCallback(snapshot_every_n_steps=1000),
        _Disarm(),
    ]
    try:
        trainer, _ = _gpu_fit(tmp_path, callbacks, max_steps=8)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert trainer.global_step == 8
    # negative control: a check on every step reads the flags, which the debug mode must catch
    callbacks = [_Arm(), NumericalHealthCallback(check_every_n_steps=1, spike_detection=False), _Disarm()]
    with pytest.raises(RuntimeError, match="synchroniz"):
        try:
            _gpu_fit(tmp_path, callbacks, max_steps=3)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.fixture(scope="module")
def clean_gpu(tmp_path_factory):
    _, module = fit(
        tmp_path_factory.mktemp("g"),
        [NumericalHealthCallback(check_every_n_steps=1), NaNRollbackCallback(snapshot_every_n_steps=4)],
        max_steps=20,
        module=CudaToy,
        accelerator="gpu",
    )
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("check_every", [1, 3])
@pytest.mark.parametrize("target", ["loss", "gradient", "parameter", "batch"])
def test_transient_fault_bitwise_on_gpu(tmp_path, clean_gpu, target, check_every):
    health = NumericalHealthCallback(check_every_n_steps=check_every)
    callbacks = [FaultInjectionCallback(target, steps=[6]), health, NaNRollbackCallback(snapshot_every_n_steps=4)]
    _, module = _gpu_fit(tmp_path, callbacks, max_steps=20)
    assert ("transient", 6) in [(e["kind"], e["step"]) for e in health.events.events]
    assert state_equal(module.state_dict(), clean_gpu)


@pytest.mark.parametrize("policy", ["skip", "lower_lr", "stop"])
def test_persistent_fault_on_gpu(tmp_path, policy):
    health = NumericalHealthCallback(check_every_n_steps=2)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy=policy, max_retries=2)
    _, module = _gpu_fit(tmp_path, [FaultInjectionCallback("loss", steps=[7], mode="always"), health, rollback], 20)
    kinds = [e["kind"] for e in health.events.events]
    assert "reproducible" in kinds and "diagnosis" in kinds
    assert rollback.stopped == (policy != "skip")
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_locator_on_gpu():
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()).cuda()
    found = locate_nonfinite(lambda x: torch.log(net(x) * 0).sum(), torch.randn(2, 3, device="cuda"), module=net)
    assert found.op == "aten.log.default" and found.phase == "forward"


def test_deepep_transient_bitwise_on_gpu(tmp_path):
    def make():
        return DeepEPModule(
            **grouped(num_envs=64, rollout_length=32, hidden_size=64, steps_per_epoch=30, fused_value_head=False)
        )

    _, clean = _gpu_fit(
        tmp_path,
        [NumericalHealthCallback(check_every_n_steps=5), NaNRollbackCallback(snapshot_every_n_steps=10)],
        30,
        module=make,
    )
    health = NumericalHealthCallback(check_every_n_steps=5)
    callbacks = [FaultInjectionCallback("gradient", steps=[17]), health, NaNRollbackCallback(snapshot_every_n_steps=10)]
    _, faulty = _gpu_fit(tmp_path, callbacks, 30, module=make)
    assert ("transient", 17) in [(e["kind"], e["step"]) for e in health.events.events]
    assert state_equal(clean.state_dict(), faulty.state_dict())
    assert clean.rollout_state_dict()["rollout_step"] == faulty.rollout_state_dict()["rollout_step"] == 30


# ---------------------------------------------------------------- the CUDA-graph path
GRAPH = dict(num_envs=64, rollout_length=32, hidden_size=64, steps_per_epoch=40, fused_value_head=False)


def _graph_module():
    return DeepEPModule(**grouped(**GRAPH, cuda_graph=True))


class UncapturedGraphModule(DeepEPModule):
    """The graph path's code with every step uncaptured: the eager reference for the graph."""

    def training_step(self, batch, batch_idx):
        with self.uncaptured_steps():
            return super().training_step(batch, batch_idx)


def _kinds(health):
    return [(e["kind"], e["step"]) for e in health.events.events]


def _optimizer_state_equal(a, b):
    sa, sb = a.optimizers[0].state_dict()["state"], b.optimizers[0].state_dict()["state"]
    return sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_graph_transient_fault_rolled_back_in_place_bitwise(tmp_path):
    clean_trainer, clean = _gpu_fit(
        tmp_path / "clean",
        [NumericalHealthCallback(check_every_n_steps=5), NaNRollbackCallback(snapshot_every_n_steps=10)],
        30,
        module=_graph_module,
    )
    health, recorder = NumericalHealthCallback(check_every_n_steps=5), Recorder()
    callbacks = [
        FaultInjectionCallback("parameter", steps=[17]),
        health,
        NaNRollbackCallback(snapshot_every_n_steps=10),
        recorder,
    ]
    trainer, faulty = _gpu_fit(tmp_path / "faulty", callbacks, 30, module=_graph_module)
    # caught at the first check after it (step 20), named as step 17; replayed from the snapshot of step 10
    assert _kinds(health) == [("detected", 17), ("rollback", 10), ("transient", 17)]
    assert faulty.graph_training.captures == clean.graph_training.captures == 1  # the rollback kept the graph
    # restored in place: every parameter and optimizer-state tensor is still the one the graph points to
    assert recorder.first == recorder.last
    # training went on from the restored state, through the graph, exactly as if the fault never happened
    assert trainer.global_step == 30 and torch.isfinite(recorder.outputs[-1]["loss"])
    assert state_equal(clean.state_dict(), faulty.state_dict()) and _optimizer_state_equal(clean_trainer, trainer)
    a, b = clean.rollout_state_dict(), faulty.rollout_state_dict()
    assert a["rollout_step"] == b["rollout_step"] == 30 and torch.equal(a["hidden"], b["hidden"])
    assert all(torch.equal(a["env"][k], b["env"][k]) for k in a["env"])


def test_graph_without_rollback_the_nan_reaches_the_weights(tmp_path):
    """Negative control: the planted NaN goes through the captured update into every weight."""
    health = NumericalHealthCallback(check_every_n_steps=1, on_nonfinite="warn")
    with pytest.warns(UserWarning, match="nonfinite_loss at step 7"):
        _, module = _gpu_fit(
            tmp_path, [FaultInjectionCallback("parameter", steps=[7]), health], 12, module=_graph_module
        )
    assert module.graph_training.captures == 1
    assert not any(torch.isfinite(p).all() for p in module.parameters())


def test_graph_overflow_detected_on_its_step_and_op_named(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="stop")
    _, module = _gpu_fit(tmp_path, [OverflowBeforeStep(7), health, rollback], 12, module=_graph_module)
    assert _kinds(health)[:3] == [("detected", 7), ("rollback", 4), ("reproducible", 7)]
    diagnosis = next(e for e in health.events.events if e["kind"] == "diagnosis")
    # the op inside the graph (run uncaptured for the locator), as on the eager path
    assert diagnosis["op"] == "aten.pow.Tensor_Scalar" and "loss.py" in diagnosis["report"]
    assert rollback.stopped and all(torch.isfinite(p).all() for p in module.parameters())


def test_graph_diagnosis_without_uncaptured_step_cannot_see_inside(tmp_path):
    """Negative control: the locator on the graph replay itself sees only what follows the graph."""

    class Opaque(DeepEPModule):
        uncaptured_steps = None

    health = NumericalHealthCallback(check_every_n_steps=1)
    _gpu_fit(
        tmp_path,
        [OverflowBeforeStep(7), health, NaNRollbackCallback(snapshot_every_n_steps=4, policy="stop")],
        12,
        module=lambda: Opaque(**grouped(**GRAPH, cuda_graph=True)),
    )
    diagnosis = next(e for e in health.events.events if e["kind"] == "diagnosis")
    assert diagnosis["op"] != "aten.pow.Tensor_Scalar" and "loss.py" not in diagnosis["report"]


def test_graph_persistent_reported_loss_fault_skipped(tmp_path):
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, policy="skip")
    trainer, module = _gpu_fit(
        tmp_path, [FaultInjectionCallback("loss", steps=[7], mode="always"), health, rollback], 12, module=_graph_module
    )
    kinds = [k for k, _ in _kinds(health)]
    assert kinds == ["detected", "rollback", "reproducible", "diagnosis", "policy", "rollback", "recovered"]
    assert trainer.global_step == 12 and module.rollout_state_dict()["rollout_step"] == 12 and not rollback.stopped
    assert module.graph_training.captures == 1 and all(torch.isfinite(p).all() for p in module.parameters())


def _lower_lr_run(tmp_path, module):
    # planted for the original step and the replay that classifies it; gone when the lower rate is tried
    health = NumericalHealthCallback(check_every_n_steps=1)
    rollback = NaNRollbackCallback(
        snapshot_every_n_steps=4, policy="lower_lr", lr_factor=0.5, max_retries=2, locate=False
    )
    trainer, module = _gpu_fit(tmp_path, [OverflowBeforeStep(7, times=2), health, rollback], 14, module=module)
    kinds = [k for k, _ in _kinds(health)]
    assert kinds == ["detected", "rollback", "reproducible", "policy", "rollback", "recovered"]
    assert trainer.global_step == 14 and rollback.state_dict()["lr_scale"] == 0.5
    assert trainer.optimizers[0].param_groups[0]["lr"] == module.config.optim.learning_rate * 0.5
    return module


def test_graph_lower_lr_recaptures_and_trains_at_the_lower_rate(tmp_path, monkeypatch):
    graphed = _lower_lr_run(tmp_path / "graph", _graph_module)
    assert graphed.graph_training.captures == 2  # the lowered learning rate is baked into a new capture
    eager = _lower_lr_run(tmp_path / "eager", lambda: UncapturedGraphModule(**grouped(**GRAPH, cuda_graph=True)))
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(graphed.state_dict()[key], value, rtol=1e-3, atol=1e-4, msg=key)
    # negative control: a graph kept across the change goes on with the old rate, and the comparison sees it
    monkeypatch.setattr(graph_training, "graph_capture_key", lambda optimizer: None)
    stale = _lower_lr_run(tmp_path / "stale", _graph_module)
    assert stale.graph_training.captures == 1
    assert any(
        not torch.allclose(stale.state_dict()[k], v, rtol=1e-3, atol=1e-4) for k, v in eager.state_dict().items()
    )


def test_graph_refuses_to_replay_after_a_restore_that_is_not_in_place(tmp_path, monkeypatch):
    """Negative control for the in-place restore: a replaced optimizer state is caught before any replay."""
    monkeypatch.setattr(
        snapshot_module,
        "restore_optimizer",
        lambda optimizer, saved: optimizer.load_state_dict(state_copies.to_device(saved)),
    )
    callbacks = [
        FaultInjectionCallback("parameter", steps=[7]),
        NumericalHealthCallback(check_every_n_steps=1),
        NaNRollbackCallback(snapshot_every_n_steps=4),
    ]
    with pytest.raises(RuntimeError, match="replaced since the capture"):
        _gpu_fit(tmp_path, callbacks, 12, module=_graph_module)


# ---------------------------------------------------------------- skip and regression on the graph path
class _DisarmBeforeChecks(pl.Callback):
    """First in the callback list: disarms the sync debug mode before a check's batch-end (a check reads, by design)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every == 0:
            torch.cuda.set_sync_debug_mode(0)


class _Weights(pl.Callback):
    def __init__(self):
        self.after = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]  # device copies


def test_graph_skipped_steps_drop_their_update_without_a_host_sync(tmp_path):
    """The skip keeps the step's outputs (never None) and undoes its update with device copies only."""
    health = NumericalHealthCallback(check_every_n_steps=4, spike_detection=False)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=1000, policy="skip")
    rollback.load_state_dict({"skip_steps": [5, 6]})
    weights, recorder = _Weights(), Recorder()
    callbacks = [_DisarmBeforeChecks(4), _Arm(), health, rollback, weights, recorder, _Disarm()]
    try:
        trainer, module = _gpu_fit(tmp_path, callbacks, 10, module=_graph_module)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert trainer.global_step == 10 and module.graph_training.captures == 1 and recorder.first == recorder.last
    assert all(torch.equal(a, b) for a, b in zip(weights.after[7], weights.after[5]))  # steps 5, 6 dropped
    assert not all(torch.equal(a, b) for a, b in zip(weights.after[8], weights.after[7]))  # step 7 updates
    assert "loss" in recorder.outputs[5] and health.events.events == []  # a skipped step is no new failure


def test_graph_regression_trigger_reads_only_at_checks_and_restores_in_place(tmp_path):
    """The entropy collapse of test_regression on the graph path: rolled back in place, one capture, no sync."""
    from .test_regression import deepep_regression_run, entropy_trigger

    trainer, module, health = deepep_regression_run(tmp_path, entropy_trigger(), accelerator="gpu", cuda_graph=True)
    assert [e["kind"] for e in health.events.events] == ["regression", "rollback", "policy", "recovered"]
    assert module.graph_training.captures == 1  # weights restored in place: the graph kept its pointers
    assert float(trainer.callback_metrics["train/entropy"]) > 0.6


def test_graph_regression_trigger_adds_no_sync_between_checks(tmp_path):
    from .test_regression import entropy_trigger

    health = NumericalHealthCallback(check_every_n_steps=4, spike_detection=False)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=4, regression=entropy_trigger())
    callbacks = [_DisarmBeforeChecks(4), _Arm(), health, rollback, _Disarm()]
    try:
        trainer, _ = _gpu_fit(tmp_path, callbacks, 12, module=_graph_module)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert trainer.global_step == 12 and rollback.regression.checks == 3  # read at the three checks only
