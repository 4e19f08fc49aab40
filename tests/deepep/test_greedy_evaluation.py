"""The greedy evaluation: each environment's first episode under argmax actions, logged as eval/greedy_return."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import TensorBoardLogger

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep import module as module_of_deepep
from deepep_lightning.deepep.config import DeepEPConfig, EnvConfig, ExecutionConfig, NetworkConfig
from deepep_lightning.deepep.envs.cartpole import BatchedCartPole
from deepep_lightning.deepep.greedy_evaluation import greedy_returns
from deepep_lightning.determinism.streams import derive_seed


def _agent(policy_reads_hidden: bool, seed: int):
    config = DeepEPConfig(network=NetworkConfig(hidden_size=16, policy_reads_hidden=policy_reads_hidden), seed=seed)
    return config.build_agent()


def _one_env_at_a_time(agent, start_states: torch.Tensor) -> list[float]:
    """Reference: each start state alone, stepped until its episode ends, with the agent's full greedy step."""
    returns = []
    for state in start_states:
        env = BatchedCartPole(1)
        env.reset(torch.Generator().manual_seed(0))
        env.state.copy_(state.unsqueeze(0))
        obs, hidden, total = env.observe(), agent.initial_state(1, "cpu"), 0.0
        while True:
            with torch.no_grad():
                step = agent.step(obs, hidden, None)
            result = env.step(step.action, torch.Generator().manual_seed(1))
            total += float(result.reward)
            if bool(result.done):
                returns.append(total)
                break
            obs, hidden = result.obs, step.hidden
    return returns


def _needs_extension(fused):
    from deepep_lightning.ops import extension_available

    if fused and not extension_available():
        pytest.skip("the fused evaluation needs the compiled deepep extension")


@pytest.mark.parametrize("fused", [False, True], ids=["op_by_op", "kernel"])
@pytest.mark.parametrize("policy_reads_hidden", [True, False])
@pytest.mark.parametrize("seed", [0, 3])
def test_each_return_is_its_environments_first_episode_under_argmax_actions(policy_reads_hidden, seed, fused):
    _needs_extension(fused)
    agent = _agent(policy_reads_hidden, seed)
    with torch.no_grad():  # a policy that balances for a while: push towards the side the pole leans to
        agent.policy_net[2].weight.zero_()
        agent.policy_net[2].bias.zero_()
        agent.policy_net[0].weight.zero_()
        agent.policy_net[0].weight[0, 2] = 1.0  # hidden unit 0 = tanh(theta)
        agent.policy_net[0].bias.zero_()
        agent.policy_net[2].weight[1, 0] = 10.0  # logit of "right" grows with theta
    env = BatchedCartPole(16)
    returns = greedy_returns(agent, env, seed=seed, fused=fused)
    # the same start states: the evaluation's generator reset a fresh env of the same size
    probe = BatchedCartPole(16)
    probe.reset(torch.Generator().manual_seed(derive_seed(seed, "greedy_evaluation")))
    expected = _one_env_at_a_time(agent, probe.state.clone())
    assert returns.tolist() == expected
    assert min(expected) > 20  # the planted policy balances: episodes longer than a random policy's ~22 steps
    assert torch.equal(greedy_returns(agent, BatchedCartPole(16), seed=seed, fused=fused), returns)  # repeats


def test_the_kernel_evaluation_refuses_what_the_kernel_cannot_run_by_name():
    _needs_extension(True)
    agent = DeepEPConfig(network=NetworkConfig(hidden_size=16), seed=0).build_agent().double()
    with pytest.raises(ValueError, match="greedy_steps_fused: the fused rollout needs float32 or float64 for every"):
        greedy_returns(agent, BatchedCartPole(4), seed=0, fused=True)  # float64 agent, float32 env


def test_a_policy_that_always_pushes_right_ends_every_episode_within_a_few_dozen_steps():
    agent = _agent(False, 0)
    with torch.no_grad():
        agent.policy_net[2].weight.zero_()
        agent.policy_net[2].bias.copy_(torch.tensor([0.0, 5.0]))
    returns = greedy_returns(agent, BatchedCartPole(32), seed=0)
    assert returns.shape == (32,) and bool((returns > 0).all()) and float(returns.max()) < 60


def _fit(tmp_path, name, eval_envs, max_steps=40, **execution):
    pl.seed_everything(0)
    model = DeepEPModule(
        env=EnvConfig(num_envs=8, rollout_length=8, steps_per_epoch=30, eval_envs=eval_envs, eval_every_n_steps=20),
        network=NetworkConfig(hidden_size=16),
        **({"execution": ExecutionConfig(**execution)} if execution else {}),
    )
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=TensorBoardLogger(tmp_path, name=name, version=0),
        log_every_n_steps=10, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    return model, trainer


def _scalars(tmp_path, name, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (tmp_path / name / "version_0").glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    return (
        [(event.step, event.value) for event in accumulator.Scalars(tag)]
        if tag in accumulator.Tags()["scalars"]
        else []
    )


def test_a_fit_with_the_evaluation_trains_the_same_bits_and_logs_each_evaluation_once(tmp_path, monkeypatch):
    with_evaluation, trainer = _fit(tmp_path, "with", eval_envs=8)
    without, _ = _fit(tmp_path, "without", eval_envs=0)
    state = without.state_dict()
    assert all(torch.equal(value, state[key]) for key, value in with_evaluation.state_dict().items())
    logged = _scalars(tmp_path, "with", "eval/greedy_return")
    assert [step for step, _ in logged] == [19, 39]  # every 20 steps, once each (Lightning writes at 9, 19, 29, 39)
    assert all(0 < value <= 500 for _, value in logged)
    assert float(trainer.callback_metrics["eval/greedy_return"]) == logged[-1][1]
    assert _scalars(tmp_path, "without", "eval/greedy_return") == []
    # negative control: an evaluation that steps the training environments changes what the run trains
    monkeypatch.setattr(module_of_deepep, "make_env", lambda *args, **kwargs: planted.rollout_state.env)
    pl.seed_everything(0)
    planted = DeepEPModule(
        env=EnvConfig(num_envs=8, rollout_length=8, steps_per_epoch=30, eval_envs=8, eval_every_n_steps=20),
        network=NetworkConfig(hidden_size=16),
    )
    pl.Trainer(
        max_steps=40, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=10,
    ).fit(planted)  # fmt: skip
    planted_state = planted.state_dict()
    assert not all(torch.equal(value, planted_state[key]) for key, value in state.items())


def test_the_evaluation_runs_as_one_kernel_launch_where_the_training_rollout_does(tmp_path, monkeypatch):
    from deepep_lightning.deepep import greedy_evaluation

    _needs_extension(True)
    launches = []
    kernel = greedy_evaluation.greedy_steps_fused
    monkeypatch.setattr(greedy_evaluation, "greedy_steps_fused", lambda *a, **k: launches.append(1) or kernel(*a, **k))
    _, fused = _fit(tmp_path, "fused", eval_envs=8, fused_bptt=True, fused_rollout=True)
    assert len(launches) == 2  # steps 19 and 39
    _, op_by_op = _fit(tmp_path, "op_by_op", eval_envs=8, fused_bptt=True, fused_rollout=False)
    assert len(launches) == 2  # the op-by-op rollout's module evaluates op by op
    assert _scalars(tmp_path, "fused", "eval/greedy_return") == _scalars(tmp_path, "op_by_op", "eval/greedy_return")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("eval_envs", -1, "`EnvConfig(eval_envs=...)` must be a non-negative int (0: no greedy evaluation), got -1"),
        (
            "eval_envs",
            True,
            "`EnvConfig(eval_envs=...)` must be a non-negative int (0: no greedy evaluation), got True",
        ),
        ("eval_every_n_steps", 0, "`EnvConfig(eval_every_n_steps=...)` must be a positive int, got 0"),
    ],
)
def test_bad_evaluation_settings_are_refused_by_name(field, value, message):
    with pytest.raises(MisconfigurationException) as raised:
        EnvConfig(**{field: value})
    assert str(raised.value) == message


@pytest.mark.gpu
@pytest.mark.parametrize("policy_reads_hidden", [True, False])
def test_gpu_kernel_evaluation_gives_the_op_by_op_returns(policy_reads_hidden):
    """On CUDA (float32: the cluster kernel on Hopper) the one-launch evaluation returns the op-by-op loop's returns."""
    from deepep_lightning.ops import cuda_kernels_available

    if not torch.cuda.is_available() or not cuda_kernels_available():
        pytest.skip("needs CUDA and the compiled deepep CUDA kernels")
    agent = _agent(policy_reads_hidden, 0).cuda()
    with torch.no_grad():  # the balancing policy of the CPU test: logit of "right" = 10 tanh(theta)
        for layer in (agent.policy_net[0], agent.policy_net[2]):
            layer.weight.zero_()
            layer.bias.zero_()
        agent.policy_net[0].weight[0, 2] = 1.0
        agent.policy_net[2].weight[1, 0] = 10.0
    fused = greedy_returns(agent, BatchedCartPole(64, "cuda"), seed=0, fused=True)
    op_by_op = greedy_returns(agent, BatchedCartPole(64, "cuda"), seed=0)
    assert float(op_by_op.min()) > 20
    assert torch.equal(fused, op_by_op)
