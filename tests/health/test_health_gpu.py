"""GPU campaign: no host sync per step (sync debug mode), transient faults bitwise, persistent ones handled, DeepEP."""

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from deepep_lightning.audit.nonfinite import locate_nonfinite
from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback

from .conftest import ToyModule, fit, state_equal

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
    callbacks = [_Arm(), NumericalHealthCallback(check_every_n_steps=1000, spike_detection=False),
                 NaNRollbackCallback(snapshot_every_n_steps=1000), _Disarm()]
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
    _, module = fit(tmp_path_factory.mktemp("g"), [NumericalHealthCallback(check_every_n_steps=1),
                    NaNRollbackCallback(snapshot_every_n_steps=4)], max_steps=20, module=CudaToy, accelerator="gpu")
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
    from deepep_lightning.module import DeepEPModule

    def make():
        return DeepEPModule(num_envs=64, rollout_length=32, hidden_size=64, steps_per_epoch=30, fused_value_head=False)

    _, clean = _gpu_fit(tmp_path, [NumericalHealthCallback(check_every_n_steps=5),
                                   NaNRollbackCallback(snapshot_every_n_steps=10)], 30, module=make)
    health = NumericalHealthCallback(check_every_n_steps=5)
    callbacks = [FaultInjectionCallback("gradient", steps=[17]), health, NaNRollbackCallback(snapshot_every_n_steps=10)]
    _, faulty = _gpu_fit(tmp_path, callbacks, 30, module=make)
    assert ("transient", 17) in [(e["kind"], e["step"]) for e in health.events.events]
    assert state_equal(clean.state_dict(), faulty.state_dict())
    assert clean.rollout_state_dict()["rollout_step"] == faulty.rollout_state_dict()["rollout_step"] == 30
