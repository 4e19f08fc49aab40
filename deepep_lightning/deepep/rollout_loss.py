"""DeepEPModule's rollout and loss: the collection path (op by op, fused BPTT, compiled timestep) and the loss terms.

Both training paths run this: the eager step (Lightning's automatic optimisation, virtual ranks) and the
CUDA-graph step (:mod:`~deepep_lightning.deepep.graph_training`), which captures it. A file of its own:
it is what a training step computes, apart from how the step is run and logged.
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
    from deepep_lightning.deepep.module import DeepEPModule

__all__ = ["fused_bptt_on", "fused_rollout_on", "rollout_and_loss"]


def rollout_and_loss(module: DeepEPModule, first_of_step: bool = True) -> tuple[Any, Any]:
    """One rollout of ``module``'s current (virtual) rank and its loss terms; the recurrent state moves on.

    ``first_of_step``: the first rollout of an optimizer step, where the target networks take their Polyak
    step (with virtual ranks, only the first micro-batch's).
    """
    hp = module.hparams
    assert module._env is not None and module._hidden is not None and module._generator is not None
    if hp.target_tau is not None and first_of_step:
        # Before the rollout, so the target follows the weights of the previous optimizer step on both paths.
        assert module.agent.target_value_head is not None
        polyak_update_(
            list(module.agent.target_parameters()), list(module.agent.online_parameters_of_targets()), hp.target_tau
        )
    if hp.compile_step and (module._compiled_timestep is None or module._compiled_timestep.env is not module._env):
        module._compiled_timestep = CompiledTimestep(module.agent, module._env)
    timestep = module._compiled_timestep if hp.compile_step else None
    args = (module.agent, module._env, module._hidden.clone(), hp.rollout_length, module._generator, hp.bptt_truncation)
    if module._fused_bptt_on():
        rollout = collect_rollout_fused(*args, timestep=timestep, fused_rollout=fused_rollout_on(module))
    else:
        rollout = collect_rollout(*args, timestep=timestep)
    module._hidden.copy_(rollout.final_hidden)
    # with virtual ranks every process adds the K rollouts in order instead (virtual_ranks.end_virtual_step)
    if not module._virtual:
        module.episode_return_100.update(rollout.episode_returns, rollout.dones)
    target_q, bootstrap = None, rollout.bootstrap_value
    if hp.target_tau is not None:
        all_target_q = module.agent.target_q(rollout.features)  # [T + 1, B, A]
        target_q = all_target_q[:-1]
        bootstrap = (torch.softmax(rollout.bootstrap_logits, dim=-1) * all_target_q[-1]).sum(dim=-1)
    entropy_coef: float | torch.Tensor = hp.entropy_coef
    if hp.target_entropy is not None:
        entropy_coef = module.log_entropy_coef.exp()  # a new tensor: the in-place update below leaves it alone
    terms = deepep_loss(
        rollout.logits,
        rollout.q,
        rollout.actions,
        rollout.rewards * hp.reward_scale,
        rollout.terminateds,
        bootstrap,
        gamma=hp.gamma,
        gae_lambda=hp.gae_lambda,
        value_coef=hp.value_coef,
        entropy_coef=entropy_coef,
        target_q=target_q,
        target_logits=module.agent.target_logits(rollout.features[:-1]) if hp.kl_coef > 0 else None,
        kl_coef=hp.kl_coef,
        expected_value_coef=hp.expected_value_coef,
    )
    if hp.target_entropy is not None:
        adapt_entropy_coef_(
            module.log_entropy_coef,
            terms.entropy,
            hp.target_entropy,
            hp.entropy_coef_rate,
            hp.entropy_coef,
            hp.entropy_coef_max,
        )
    return rollout, terms


def fused_bptt_on(module: DeepEPModule) -> bool:
    """``fused_bptt`` resolved for the module's device (None: on with CUDA and the extension's CUDA kernels)."""
    choice = module.hparams.get("fused_bptt")
    if choice is not None:
        return bool(choice)
    return module.hparams.detach_feedback and module.device.type == "cuda" and _cuda_kernels_load()


def fused_rollout_on(module: DeepEPModule) -> bool:
    """``fused_rollout`` resolved for this rollout (None: on with CUDA where the kernel runs the agent and env).

    Under None on CUDA a rollout the kernel cannot run takes the op-by-op timesteps after one warning per
    module naming why (none when the CUDA kernels were not built: the extension's loader has said so).

    Raises:
        ValueError: ``fused_rollout=True`` and the kernel cannot run this rollout (the reason named).
    """
    choice = module.hparams.get("fused_rollout")
    if choice is False or module.hparams.compile_step or (choice is None and module.device.type != "cuda"):
        return False
    assert module._env is not None
    reason = fused_rollout_unsupported_reason(module.agent, module._env)
    if reason is None:
        return True
    if choice:
        raise ValueError(f"`DeepEPModule(fused_rollout=True)`: {reason} (HINT: leave fused_rollout at None)")
    if module not in _warned_op_by_op and _cuda_kernels_load():
        _warned_op_by_op.add(module)
        rank_zero_warn(
            f"`DeepEPModule(fused_rollout=None)`: the rollout's timesteps run op by op, not as one "
            f"deepep::cartpole_rollout launch: {reason}. HINT: pass fused_rollout=False to choose the op-by-op "
            "rollout without this warning."
        )
    return False


#: Modules already told why their rollout runs op by op (weak: a module's entry goes with it).
_warned_op_by_op: weakref.WeakSet = weakref.WeakSet()


def _cuda_kernels_load() -> bool:
    try:
        from deepep_lightning.ops import cuda_kernels_available
    except ImportError:
        return False
    return bool(cuda_kernels_available())
