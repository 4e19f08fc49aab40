"""One rollout and its loss terms: the collection path (op by op, fused BPTT, compiled timestep) and the loss.

Both training paths run :func:`rollout_and_loss`: the eager step (Lightning's automatic optimisation,
virtual ranks) and the CUDA-graph step (:class:`~deepep_lightning.deepep.graph_training.GraphTraining`),
which captures it. It is a function of the agent, one rank's
:class:`~deepep_lightning.deepep.rollout_state.RolloutState` and the hyperparameters: what a training
step computes, apart from how the step is run and logged.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from deepep_lightning.deepep.agent import collect_rollout, deepep_loss
from deepep_lightning.deepep.agent.compiled_step import CompiledTimestep
from deepep_lightning.deepep.agent.fused_bptt import collect_rollout_fused
from deepep_lightning.deepep.agent.fused_rollout import fused_rollout_unsupported_reason
from deepep_lightning.deepep.agent.targets import adapt_entropy_coef_, polyak_update_

if TYPE_CHECKING:
    from deepep_lightning.deepep.agent import DeepEPAgent
    from deepep_lightning.deepep.config import DeepEPConfig
    from deepep_lightning.deepep.envs.base import BatchedEnv
    from deepep_lightning.deepep.rollout_state import RolloutState

__all__ = ["fused_bptt_on", "fused_rollout_on", "rollout_and_loss"]


def rollout_and_loss(
    agent: DeepEPAgent,
    state: RolloutState,
    config: DeepEPConfig,
    log_entropy_coef: torch.Tensor | None = None,
    first_of_step: bool = True,
) -> tuple[Any, Any]:
    """One rollout of ``agent`` on ``state`` and its loss terms; ``state``'s recurrent state moves on in place.

    Args:
        agent: the online networks (and the target networks with ``target_tau``).
        state: the rollout state of one (virtual) rank, its generator already seeded for the step.
        config: the module's hyperparameters.
        log_entropy_coef: ``log α`` of the adaptive entropy coefficient (``target_entropy``), updated in place.
        first_of_step: the first rollout of an optimizer step, where the target networks take their Polyak
            step (with virtual ranks, only the first micro-batch's).

    Returns:
        ``(rollout, terms)``: the collected :class:`~deepep_lightning.deepep.agent.rollout.Rollout` and the
        :class:`~deepep_lightning.deepep.agent.loss.LossTerms`.
    """
    loss, run = config.loss, config.execution
    if loss.target_tau is not None and first_of_step:
        # Before the rollout, so the target follows the weights of the previous optimizer step on both paths.
        assert agent.target_value_head is not None
        polyak_update_(list(agent.target_parameters()), list(agent.online_parameters_of_targets()), loss.target_tau)
    if run.compile_step and (state.compiled_timestep is None or state.compiled_timestep.env is not state.env):
        state.compiled_timestep = CompiledTimestep(agent, state.env)
    timestep = state.compiled_timestep if run.compile_step else None
    args = (agent, state.env, state.hidden.clone(), config.env.rollout_length, state.generator, loss.bptt_truncation)
    if fused_bptt_on(config, state.device):
        kernel = fused_rollout_on(config, agent, state.env, state.device)
        rollout = collect_rollout_fused(*args, timestep=timestep, fused_rollout=kernel)
    else:
        rollout = collect_rollout(*args, timestep=timestep)
    state.hidden.copy_(rollout.final_hidden)
    target_q, bootstrap = None, rollout.bootstrap_value
    if loss.target_tau is not None:
        all_target_q = agent.target_q(rollout.features)  # [T + 1, B, A]
        target_q = all_target_q[:-1]
        bootstrap = (torch.softmax(rollout.bootstrap_logits, dim=-1) * all_target_q[-1]).sum(dim=-1)
    entropy_coef: float | torch.Tensor = loss.entropy_coef
    if loss.target_entropy is not None:
        assert log_entropy_coef is not None
        entropy_coef = log_entropy_coef.exp()  # a new tensor: the in-place update below leaves it alone
    terms = deepep_loss(
        rollout.logits,
        rollout.q,
        rollout.actions,
        rollout.rewards * loss.reward_scale,
        rollout.terminateds,
        bootstrap,
        gamma=loss.gamma,
        gae_lambda=loss.gae_lambda,
        value_coef=loss.value_coef,
        entropy_coef=entropy_coef,
        target_q=target_q,
        target_logits=agent.target_logits(rollout.features[:-1]) if loss.kl_coef > 0 else None,
        kl_coef=loss.kl_coef,
        expected_value_coef=loss.expected_value_coef,
    )
    if loss.target_entropy is not None:
        assert log_entropy_coef is not None
        adapt_entropy_coef_(
            log_entropy_coef, terms.entropy, loss.target_entropy, loss.entropy_coef_rate, loss.entropy_coef,
            loss.entropy_coef_max,
        )  # fmt: skip
    return rollout, terms


def fused_bptt_on(config: DeepEPConfig, device: torch.device) -> bool:
    """``fused_bptt`` resolved for ``device`` (None: on with CUDA and the extension's CUDA kernels)."""
    choice = config.execution.fused_bptt
    if choice is not None:
        return bool(choice)
    return config.network.detach_feedback and device.type == "cuda" and _cuda_kernels_load()


def fused_rollout_on(config: DeepEPConfig, agent: DeepEPAgent, env: BatchedEnv, device: torch.device) -> bool:
    """``fused_rollout`` resolved for a rollout of ``agent`` on ``env`` on ``device`` (None: on with CUDA where the
    kernel runs them).

    Under None on CUDA a rollout the kernel cannot run takes the op-by-op timesteps after one warning per
    agent naming why (none when the CUDA kernels were not built: the extension's loader has said so).

    Raises:
        ValueError: ``fused_rollout=True`` and the kernel cannot run this rollout (the reason named).
    """
    choice = config.execution.fused_rollout
    if choice is False or config.execution.compile_step or (choice is None and device.type != "cuda"):
        return False
    reason = fused_rollout_unsupported_reason(agent, env)
    if reason is None:
        return True
    if choice:
        raise ValueError(f"`ExecutionConfig(fused_rollout=True)`: {reason} (HINT: leave fused_rollout at None)")
    if agent not in _warned_op_by_op and _cuda_kernels_load():
        _warned_op_by_op.add(agent)
        rank_zero_warn(
            f"`ExecutionConfig(fused_rollout=None)`: the rollout's timesteps run op by op, not as one "
            f"deepep::cartpole_rollout launch: {reason}. HINT: pass fused_rollout=False to choose the op-by-op "
            "rollout without this warning."
        )
    return False


#: Agents already told why their rollout runs op by op (weak: an agent's entry goes with it).
_warned_op_by_op: weakref.WeakSet = weakref.WeakSet()


def _cuda_kernels_load() -> bool:
    try:
        from deepep_lightning.ops import cuda_kernels_available
    except ImportError:
        return False
    return bool(cuda_kernels_available())
