"""One rank's rollout state: the environments, recurrent state, generator and step that a training step carries on.

The data of a training step is a pure function of ``(seed, rank, step)`` and this state: the generator is
reseeded from ``derive_seed(seed, "rollout", rank, step)`` before each rollout, so a resume seeks to the step
instead of replaying the rollouts. The state is built on the module's device (after a checkpoint restore and
the move to the device), and :meth:`RolloutState.state_dict` is what checkpoints and
:class:`~deepep_lightning.NaNRollbackCallback`'s snapshots carry (through ``protocols.ROLLOUT_STATE_KEY``).
:class:`~deepep_lightning.deepep.virtual_ranks.VirtualRollouts` keeps one per virtual rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

from deepep_lightning.deepep.envs import BatchedEnv, make_env
from deepep_lightning.determinism.streams import derive_seed

if TYPE_CHECKING:
    from deepep_lightning.deepep.agent import DeepEPAgent
    from deepep_lightning.deepep.agent.compiled_step import CompiledTimestep

__all__ = ["RolloutState", "step_indices"]


class RolloutState:
    """The environments, recurrent state and generator of one (virtual) rank, and its rollout step.

    Args:
        env: the batched environments (B of them), already reset.
        hidden: the recurrent state ``[B, H]``, updated in place (a captured CUDA graph points at it).
        generator: every random draw of the rollout; reseeded by :meth:`seed_rollout`.
        rank: the (virtual) rank whose streams the generator follows.
        step: the rollout step, the index of the next training step's rollout.

    Attributes:
        compiled_timestep: the ``torch.compile``-d timestep bound to ``env`` (``compile_step=True``), built at
            the first rollout that needs it.

    Example::

        state = RolloutState.build(agent, "cartpole", 32, None, "cpu", seed=0, rank=0)
        state.seed_rollout(seed=0)  # before each rollout
    """

    def __init__(self, env: BatchedEnv, hidden: torch.Tensor, generator: torch.Generator, rank: int, step: int = 0):
        self.env, self.hidden, self.generator = env, hidden, generator
        self.rank, self.step = rank, step
        self.compiled_timestep: CompiledTimestep | None = None

    @classmethod
    def build(
        cls,
        agent: DeepEPAgent,
        env_name: str,
        num_envs: int,
        env_kwargs: dict[str, Any] | None,
        device: torch.device | str,
        seed: int,
        rank: int,
        saved: dict[str, Any] | None = None,
    ) -> RolloutState:
        """Environments, recurrent state and generator for ``rank`` on ``device``.

        The environments start from ``derive_seed(seed, "env_init", rank)``, or from ``saved`` (what
        :meth:`state_dict` returned) when given.
        """
        env = make_env(env_name, num_envs, device, **(env_kwargs or {}))
        hidden = agent.initial_state(num_envs, device)  # [B, H]
        state = cls(env, hidden, torch.Generator(device=device), rank)
        if saved:
            state.load_state_dict(saved)
        else:
            state.generator.manual_seed(derive_seed(seed, "env_init", rank))
            env.reset(state.generator)
        return state

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def seed_rollout(self, seed: int) -> None:
        """Reseed the generator for the rollout of this step: ``derive_seed(seed, "rollout", rank, step)``."""
        self.generator.manual_seed(derive_seed(seed, "rollout", self.rank, self.step))

    def state_dict(self) -> dict[str, Any]:
        """Environment states, recurrent state and the step (CPU tensors and an int)."""
        return {
            "env": {k: v.cpu() for k, v in self.env.state_dict().items()},
            "hidden": self.hidden.detach().cpu().clone(),
            "rollout_step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, in place (graph-safe); a state without a step keeps the step."""
        self.env.load_state_dict({k: v.to(self.device) for k, v in state["env"].items()})
        self.hidden.copy_(state["hidden"])
        if "rollout_step" in state:
            self.step = int(state["rollout_step"])


class _StepIndices(Dataset):
    """``count`` integers: a DeepEP training "batch" is only the index of a rollout."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> int:
        return index


def step_indices(steps_per_epoch: int, virtual_world_size: int | None) -> DataLoader:
    """The loader of an epoch's rollout indices; with virtual ranks one per micro-batch of every virtual rank, in
    batches of one that the strategy shards over the processes."""
    if virtual_world_size is not None:
        return DataLoader(_StepIndices(steps_per_epoch * virtual_world_size), batch_size=1)
    return DataLoader(_StepIndices(steps_per_epoch), batch_size=None, shuffle=False)
