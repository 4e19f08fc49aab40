"""The on-policy rollout loop: T timesteps of B environments, kept on the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepep_lightning.deepep.agent.network import AgentStep, DeepEPAgent
from deepep_lightning.deepep.envs.base import BatchedEnv, StepResult

__all__ = ["Rollout", "Timestep", "collect_rollout", "eager_timestep"]

#: One timestep of the rollout loop: ``(obs [B, obs_dim], hidden [B, H], generator)`` to the agent's step,
#: the env's step and the next recurrent state ``[B, H]`` (zeroed where an episode ended).
Timestep = Callable[[torch.Tensor, torch.Tensor, torch.Generator], tuple[AgentStep, StepResult, torch.Tensor]]


@dataclass
class Rollout:
    """A rollout of T steps over B environments; tensors are ``[T, B, ...]``."""

    logits: torch.Tensor  # [T, B, A], with grad
    q: torch.Tensor  # [T, B, A], with grad
    actions: torch.Tensor  # [T, B]
    rewards: torch.Tensor  # [T, B]
    dones: torch.Tensor  # [T, B] bool: an episode ended (recurrent state reset)
    terminateds: torch.Tensor  # [T, B] bool: a true terminal (no bootstrap); dones & ~terminateds = time limit
    episode_returns: torch.Tensor  # [T, B], finished episodes' returns where dones
    bootstrap_value: torch.Tensor  # [B], V(s_T) = Σ_a π(a|s_T) Q(s_T, a), no grad
    final_hidden: torch.Tensor  # [B, H], detached
    features: torch.Tensor  # [T + 1, B, obs_dim + H] the value head's inputs at s_0..s_T, detached
    bootstrap_logits: torch.Tensor  # [B, A] policy logits at s_T, no grad


def eager_timestep(
    agent: DeepEPAgent, env: BatchedEnv, obs: torch.Tensor, hidden: torch.Tensor, generator: torch.Generator
) -> tuple[AgentStep, StepResult, torch.Tensor]:
    """One timestep, op by op: a uniform per env for the action, the agent's step, the env's step, the state reset."""
    uniform = torch.rand(env.num_envs, device=obs.device, generator=generator)
    step = agent.step(obs, hidden, uniform)
    result = env.step(step.action, generator)
    return step, result, step.hidden * (~result.done).unsqueeze(-1).to(step.hidden.dtype)


def collect_rollout(
    agent: DeepEPAgent,
    env: BatchedEnv,
    hidden: torch.Tensor,
    length: int,
    generator: torch.Generator,
    bptt_truncation: int | None = None,
    timestep: Timestep | None = None,
) -> Rollout:
    """Run ``length`` timesteps from the env's current state and recurrent state ``hidden`` ``[B, H]``.

    Gradients flow back through the whole rollout (BPTT), or through windows of
    ``bptt_truncation`` steps when set. The recurrent state is zeroed where an episode ends.
    Every step draws the same amount of randomness from ``generator`` (one uniform per env for
    the action, plus the env's own draws), so the rollout is a pure function of its inputs and
    of the generator's state, and is capturable in a CUDA graph. ``timestep`` runs each timestep
    (:class:`~deepep_lightning.deepep.agent.compiled_step.CompiledTimestep`, for one); None:
    :func:`eager_timestep`.
    """
    obs = env.observe()  # [B, obs_dim]
    logits, qs, actions, rewards, dones, terminateds, returns, features = [], [], [], [], [], [], [], []
    for t in range(length):
        if bptt_truncation is not None and t > 0 and t % bptt_truncation == 0:
            hidden = hidden.detach()
        if timestep is None:
            step, result, hidden = eager_timestep(agent, env, obs, hidden, generator)
        else:
            step, result, hidden = timestep(obs, hidden, generator)
        obs = result.obs
        logits.append(step.logits)
        features.append(step.features)
        qs.append(step.q)
        actions.append(step.action)
        rewards.append(result.reward)
        dones.append(result.done)
        terminateds.append(result.terminated)
        returns.append(result.episode_return)
    with torch.no_grad():
        last_logits, last_q = agent.evaluate(obs, hidden)
        features.append(torch.cat((obs, hidden), dim=-1))
        bootstrap = (torch.softmax(last_logits, dim=-1) * last_q).sum(dim=-1)
    return Rollout(
        torch.stack(logits),
        torch.stack(qs),
        torch.stack(actions),
        torch.stack(rewards),
        torch.stack(dones),
        torch.stack(terminateds),
        torch.stack(returns),
        bootstrap,
        hidden.detach(),
        torch.stack(features),
        last_logits,
    )
