"""DeepEPModule's rollout state: the environments, recurrent state and generator that a training step carries on.

They are built lazily on the module's device (at ``on_fit_start`` or the first step, after a checkpoint
restore and the move to the device), seeded from ``derive_seed(seed, "env_init", rank)``, and saved with
the step counter in every checkpoint, so a resume seeks to the step instead of replaying the rollouts.
A file of its own: the same state serves checkpoints, :class:`~deepep_lightning.NaNRollbackCallback`'s
snapshots (through ``protocols.ROLLOUT_STATE_KEY``) and the virtual ranks
(:mod:`~deepep_lightning.deepep.virtual_ranks`, which keeps one set per virtual rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from deepep_lightning.deepep.envs import make_env
from deepep_lightning.deepep.virtual_ranks import (
    ensure_virtual_rollouts,
    load_virtual_rollout_state,
    virtual_layout,
    virtual_rollout_state_dict,
)
from deepep_lightning.determinism.streams import derive_seed
from deepep_lightning.protocols import attached_trainer

if TYPE_CHECKING:
    from deepep_lightning.deepep.module import DeepEPModule

__all__ = ["ensure_rollout_state", "load_rollout_state_dict", "rollout_state_dict"]


def ensure_rollout_state(module: DeepEPModule) -> None:
    """Build ``module``'s environments, recurrent state and generator once (restoring a pending saved state)."""
    if module._env is not None:
        return
    trainer = attached_trainer(module)
    layout = virtual_layout(trainer.strategy) if trainer is not None else None
    if layout is not None:
        ensure_virtual_rollouts(module, *layout)
        return
    hp = module.hparams
    module._env = make_env(hp.env, hp.num_envs, module.device, **(hp.env_kwargs or {}))
    module._hidden = module.agent.initial_state(hp.num_envs, module.device)
    module._generator = torch.Generator(device=module.device)
    if module._pending_rollout_state is not None:
        state, module._pending_rollout_state = module._pending_rollout_state, None
        module.load_rollout_state_dict(state)
    else:
        module._generator.manual_seed(derive_seed(hp.seed, "env_init", module._rank()))
        module._env.reset(module._generator)


def rollout_state_dict(module: DeepEPModule) -> dict[str, Any]:
    """Environment states, recurrent state and the step counter (CPU tensors and ints)."""
    if module._env is None:
        return dict(module._pending_rollout_state) if module._pending_rollout_state else {}
    if module._virtual:
        return virtual_rollout_state_dict(module)
    assert module._hidden is not None
    return {
        "env": {k: v.cpu() for k, v in module._env.state_dict().items()},
        "hidden": module._hidden.detach().cpu().clone(),
        "rollout_step": module._rollout_step,
    }


def load_rollout_state_dict(module: DeepEPModule, state: dict[str, Any]) -> None:
    """Restore what :func:`rollout_state_dict` returned, in place (graph-safe); before the build, keep it pending."""
    if not state:
        return
    if module._env is None:
        module._pending_rollout_state = state
        return
    if module._virtual or "virtual" in state:
        load_virtual_rollout_state(module, state)
        return
    assert module._hidden is not None
    module._env.load_state_dict({k: v.to(module.device) for k, v in state["env"].items()})
    module._hidden.copy_(state["hidden"])
    module._rollout_step = int(state["rollout_step"])
