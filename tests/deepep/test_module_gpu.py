"""GPU: the CUDA-graph training step equals eager execution and is bitwise reproducible."""

import pytest
import torch

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep.agent.graphed_step import GraphedTrainStep

pytestmark = pytest.mark.gpu

SIZES = dict(num_envs=64, rollout_length=32, hidden_size=64, seed=5)


STABILISED = dict(target_tau=0.05, target_entropy=0.69, kl_coef=0.3, expected_value_coef=1.0, chrono_horizon=32)


def _train(steps, graph, fused=True, **kwargs):
    model = DeepEPModule(**SIZES, cuda_graph=graph, fused_value_head=fused, **kwargs).cuda()
    model._ensure_rollout_state()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=graph)
    graphed = GraphedTrainStep(lambda: model._whole_step(optimizer), model._generator) if graph else None
    losses = []
    for _ in range(steps):
        model._seed_rollout()
        if graph:
            outputs = graphed()
        else:
            outputs = model._whole_step(optimizer)
        losses.append(outputs["loss"].clone())
        model._rollout_step += 1
    torch.cuda.synchronize()
    return model.state_dict(), torch.stack(losses)


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
    model = DeepEPModule(**SIZES, cuda_graph=True).cuda()
    model._ensure_rollout_state()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    graphed = GraphedTrainStep(lambda: model._whole_step(optimizer), model._generator)
    for _ in range(graphed.warmup_steps + 1):
        model._seed_rollout()
        graphed()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            model._seed_rollout()
            graphed()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_lightning_fit_with_cuda_graph_runs_and_counts_steps(tmp_path):
    import lightning.pytorch as pl

    model = DeepEPModule(**SIZES, cuda_graph=True)
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
    initial = DeepEPModule(**SIZES, **STABILISED).state_dict()
    assert not torch.equal(state_a["log_entropy_coef"].cpu(), initial["log_entropy_coef"])
    assert not torch.equal(
        state_a["agent.target_value_head.output_weight"].cpu(), initial["agent.target_value_head.output_weight"]
    )


def test_graph_step_with_the_stabilisers_does_not_sync_the_host():
    model = DeepEPModule(**SIZES, cuda_graph=True, **STABILISED).cuda()
    model._ensure_rollout_state()
    optimizer = model.configure_optimizers()
    graphed = GraphedTrainStep(lambda: model._whole_step(optimizer), model._generator)
    for _ in range(graphed.warmup_steps + 1):
        model._seed_rollout()
        graphed()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            model._seed_rollout()
            graphed()
    finally:
        torch.cuda.set_sync_debug_mode("default")
