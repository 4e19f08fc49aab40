"""The greedy policy's return: one episode per environment, the most likely action at every step.

``train/episode_return_100`` is the return of the policy as it trains: actions *sampled* from its softmax,
so a policy that is right with probability 0.99 at each of 500 CartPole steps still drops the pole in some
episodes, and the rolling mean sits below 500 while the policy sharpens. The greedy return measures the
policy without that sampling: every environment starts one episode from the same start states at each
evaluation (``derive_seed(seed, "greedy_evaluation")``), takes ``argmax`` of the logits at every step (the
recurrent state is fed back as in training when the policy reads it; a policy of the observation alone runs
without the critic and the cell) and reports the return of that first episode. It draws no
number from the training streams and changes no training state, so a run with the evaluation trains the
same bits as one without it.

With ``fused=True`` (CartPole, where the module's rollout runs as one kernel launch) the episodes run as one
:func:`~deepep_lightning.deepep.agent.fused_rollout.greedy_steps_fused` launch of ``env.longest_episode``
timesteps instead of op by op: the same math, the action whose softmax probability exceeds one half (the
argmax but for logits within rounding of a tie), the critic and the cell always run.

Example::

    returns = greedy_returns(agent, make_env("cartpole", 64, "cuda"), seed=0)  # [64]
"""

from __future__ import annotations

import torch

from deepep_lightning.deepep.agent.fused_rollout import greedy_steps_fused
from deepep_lightning.deepep.agent.network import DeepEPAgent
from deepep_lightning.deepep.envs.base import BatchedEnv
from deepep_lightning.determinism.streams import derive_seed

__all__ = ["greedy_returns"]

#: Timesteps between the host's reads of "has every episode ended?" (a read waits for the device).
_CHECK_EVERY = 50


@torch.no_grad()
def greedy_returns(agent: DeepEPAgent, env: BatchedEnv, seed: int, fused: bool = False) -> torch.Tensor:
    """The return ``[B]`` of each environment's first episode under the greedy policy.

    ``env`` is reset here (from its own generator, on its device) and stepped until every environment
    has finished one episode: at most ``env.longest_episode`` steps (``fused``: exactly that many, in one launch).

    Raises:
        ValueError: ``fused`` and the rollout kernel cannot run ``agent`` on ``env`` (the reason named).
    """
    generator = torch.Generator(device=env.device).manual_seed(derive_seed(seed, "greedy_evaluation"))
    obs = env.reset(generator)
    hidden = agent.initial_state(env.num_envs, env.device)
    if fused:
        steps = greedy_steps_fused(agent, env, hidden, env.longest_episode)
        first = steps.dones.to(torch.uint8).argmax(dim=0)  # [B] each environment's first episode end
        return steps.returns.gather(0, first.unsqueeze(0)).squeeze(0)
    returns = torch.zeros(env.num_envs, device=env.device)
    running = torch.ones(env.num_envs, dtype=torch.bool, device=env.device)
    for t in range(env.longest_episode):
        if agent.policy_reads_hidden:  # the recurrent state moves the actions: advance it as training does
            step = agent.step(obs, hidden, None)
            action, hidden = step.action, step.hidden
        else:  # the actions depend on the observation alone: the critic and the cell are not needed
            action = agent.policy_logits(obs, hidden).argmax(dim=-1)
        result = env.step(action, generator)
        returns = torch.where(running & result.done, result.episode_return, returns)
        running &= ~result.done
        hidden = hidden * (~result.done).unsqueeze(-1).to(hidden.dtype)
        obs = result.obs
        if (t + 1) % _CHECK_EVERY == 0 and not bool(running.any()):
            break
    return returns
