"""GPU: the CUDA-graph training step equals eager execution and is bitwise reproducible."""

import lightning.pytorch as pl
import pytest
import torch

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep.config import grouped
from deepep_lightning.deepep.graph_training import StandaloneStep

pytestmark = pytest.mark.gpu

SIZES = dict(num_envs=64, rollout_length=32, hidden_size=64, seed=5)


STABILISED = dict(target_tau=0.05, target_entropy=0.69, kl_coef=0.3, expected_value_coef=1.0, chrono_horizon=32)


def _train(steps, graph, fused=True, **kwargs):
    model = DeepEPModule(**grouped(**SIZES, cuda_graph=graph, fused_value_head=fused, **kwargs)).cuda()
    model.ensure_rollout_state()
    step = StandaloneStep(model, torch.optim.Adam(model.parameters(), lr=1e-3, capturable=graph))
    losses = torch.stack([step()["loss"].clone() for _ in range(steps)])
    torch.cuda.synchronize()
    return model.state_dict(), losses


def test_graph_path_equals_eager_to_fp32_rounding():
    eager_state, eager_losses = _train(8, graph=False)
    graph_state, graph_losses = _train(8, graph=True)
    torch.testing.assert_close(graph_losses, eager_losses, rtol=1e-4, atol=1e-5)
    for key, value in eager_state.items():
        torch.testing.assert_close(graph_state[key], value, rtol=1e-3, atol=1e-4, msg=key)


def test_graph_path_is_bitwise_reproducible():
    state_a, losses_a = _train(8, graph=True)
    state_b, losses_b = _train(8, graph=True)
    assert torch.equal(losses_a, losses_b)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_graph_step_does_not_sync_the_host():
    model = DeepEPModule(**grouped(**SIZES, cuda_graph=True)).cuda()
    model.ensure_rollout_state()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    step = StandaloneStep(model, optimizer)
    assert step.graphed is not None
    for _ in range(step.graphed.warmup_steps + 1):
        step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_lightning_fit_with_cuda_graph_runs_and_counts_steps(tmp_path):
    import lightning.pytorch as pl

    model = DeepEPModule(**grouped(**SIZES, cuda_graph=True))
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    assert trainer.global_step == 6
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def test_graph_path_with_the_stabilisers_equals_eager_and_is_bitwise_reproducible():
    eager_state, eager_losses = _train(8, graph=False, **STABILISED)
    state_a, losses_a = _train(8, graph=True, **STABILISED)
    state_b, losses_b = _train(8, graph=True, **STABILISED)
    torch.testing.assert_close(losses_a, eager_losses, rtol=1e-4, atol=1e-5)
    for key, value in eager_state.items():
        torch.testing.assert_close(state_a[key], value, rtol=1e-3, atol=1e-4, msg=key)
    assert torch.equal(losses_a, losses_b)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    # the in-place updates ran inside the graph: targets and the entropy coefficient moved
    initial = DeepEPModule(**grouped(**SIZES, **STABILISED)).state_dict()
    assert not torch.equal(state_a["log_entropy_coef"].cpu(), initial["log_entropy_coef"])
    assert not torch.equal(
        state_a["agent.target_value_head.output_weight"].cpu(), initial["agent.target_value_head.output_weight"]
    )


def test_graph_step_with_the_stabilisers_does_not_sync_the_host():
    model = DeepEPModule(**grouped(**SIZES, cuda_graph=True, **STABILISED)).cuda()
    model.ensure_rollout_state()
    optimizer = model.configure_optimizers()
    step = StandaloneStep(model, optimizer)
    assert step.graphed is not None
    for _ in range(step.graphed.warmup_steps + 1):
        step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


class _SyncFreeWindow(pl.Callback):
    """Sync debug mode ``"error"`` from step ``first``'s start to step ``last``'s: each loop iteration in between
    (training step, every callback, Lightning's logging bookkeeping, the progress bar) runs inside it."""

    def __init__(self, first, last):
        self.first, self.last = first, last

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.cuda.set_sync_debug_mode("error" if self.first <= trainer.global_step < self.last else 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.last - 1:  # inside the window: where the logged return lives during the fit
            self.return_device = trainer.callback_metrics["train/episode_return_100"].device.type

    def on_train_end(self, trainer, pl_module):
        torch.cuda.set_sync_debug_mode(0)


def test_graph_fit_with_progress_bar_health_and_lr_monitor_syncs_no_host_between_writes(tmp_path):
    """Steps 4..10 of a graphed fit: no host sync while Lightning neither writes logs nor a check is due."""
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import TensorBoardLogger

    from deepep_lightning import NaNRollbackCallback, NumericalHealthCallback

    model = DeepEPModule(**grouped(**SIZES, cuda_graph=True, steps_per_epoch=100))
    window = _SyncFreeWindow(4, 11)
    callbacks = [
        window,  # first: its on_train_batch_start runs before the others
        NumericalHealthCallback(check_every_n_steps=1000, spike_detection=False),
        NaNRollbackCallback(snapshot_every_n_steps=1000),
        LearningRateMonitor(logging_interval="step"),
    ]
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=12,  # the last step is outside the window: reaching max_steps forces a check and a write
        log_every_n_steps=1000,
        logger=TensorBoardLogger(str(tmp_path)),
        callbacks=callbacks,
        enable_progress_bar=True,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(model)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert trainer.global_step == 12 and model.graph_training is not None and model.graph_training.captures > 0
    # during the fit the rolling return stays on the GPU (Lightning moves callback_metrics to the CPU at teardown)
    assert window.return_device == "cuda"


POLICY_STEP = dict(
    policy_adam_eps=1e-4, logit_bound=3.0, recurrent_learning_rate=3e-4, policy_reads_hidden=False, target_entropy=0.4
)


def _train_configured(steps, graph, **kwargs):
    """As ``_train``, with the module's own optimizer (its param groups carry the policy-step options)."""
    model = DeepEPModule(**grouped(**SIZES, cuda_graph=graph, fused_value_head=True, **kwargs)).cuda()
    model.ensure_rollout_state()
    optimizer = model.configure_optimizers()  # Adam(capturable=True) on the graph path
    step = StandaloneStep(model, optimizer)
    losses = torch.stack([step()["loss"].clone() for _ in range(steps)])
    torch.cuda.synchronize()
    return model.state_dict(), losses, optimizer


def test_graph_path_with_the_policy_step_options_equals_eager_and_is_bitwise_reproducible():
    eager_state, eager_losses, optimizer = _train_configured(8, graph=False, **POLICY_STEP)
    assert [group["lr"] for group in optimizer.param_groups] == [3e-3, 1e-4, 3e-4]
    assert optimizer.param_groups[1]["eps"] == 1e-4
    state_a, losses_a, _ = _train_configured(8, graph=True, **POLICY_STEP)
    state_b, losses_b, _ = _train_configured(8, graph=True, **POLICY_STEP)
    torch.testing.assert_close(losses_a, eager_losses, rtol=1e-4, atol=1e-5)
    assert torch.equal(losses_a, losses_b)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    plain_state, _, _ = _train_configured(8, graph=True)
    assert any(not torch.equal(state_a[k], plain_state[k]) for k in plain_state)  # negative control


def test_graph_path_under_lr_decay_recaptures_once_per_stair_and_equals_eager():
    decay = dict(lr_decay_steps=8, lr_decay_stages=4)
    model = DeepEPModule(**grouped(**SIZES, cuda_graph=True, fused_value_head=True, **decay)).cuda()
    step = StandaloneStep(model, model.configure_optimizers())
    graph_losses = torch.stack([step()["loss"].clone() for _ in range(8)])
    assert step.graphed is not None and step.graphed.captures == 3  # stairs 2-4 (stair 1 is in the warm-up)
    assert step.optimizer.param_groups[0]["lr"] == pytest.approx(0.25 * step.optimizer.param_groups[0]["initial_lr"])
    _, eager_losses, _ = _train_configured(8, graph=False, **decay)
    torch.testing.assert_close(graph_losses, eager_losses, rtol=1e-4, atol=1e-5)
    _, constant_losses, _ = _train_configured(8, graph=False)
    assert not torch.allclose(eager_losses[-2:], constant_losses[-2:])  # negative control: the decay acts


def _fit_with_graph(eval_envs):
    pl.seed_everything(0)
    model = DeepEPModule(
        **grouped(**SIZES, cuda_graph=True, policy_reads_hidden=False, eval_envs=eval_envs, eval_every_n_steps=10)
    )
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, max_steps=30, logger=False, log_every_n_steps=10, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    return model.state_dict(), trainer.callback_metrics


def test_the_greedy_evaluation_between_graph_replays_leaves_the_training_bits_alone():
    with_evaluation, metrics = _fit_with_graph(eval_envs=16)
    without, _ = _fit_with_graph(eval_envs=0)
    assert all(torch.equal(value, without[key]) for key, value in with_evaluation.items())
    assert 0 < float(metrics["eval/greedy_return"]) <= 500
