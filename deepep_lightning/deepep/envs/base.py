"""What every batched environment provides: tensors in, tensors out, no Python loop over envs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BatchedEnv", "StepResult"]


@dataclass
class StepResult:
    """One step of ``num_envs`` environments (all tensors ``[B]`` except ``obs``).

    Auto-reset convention: where ``done`` is true the episode ended *on this step*;
    ``reward`` is the reward of that last step, ``episode_return``/``episode_length``
    are the finished episode's totals, and ``obs`` is already the **first observation of
    the next episode** (the last observation is not returned). ``terminated`` marks a true end
    (no value beyond it); ``done & ~terminated`` is a time-limit truncation, where the agent keeps
    bootstrapping. Where ``done`` is false, ``episode_return`` is 0.
    """

    obs: torch.Tensor  # [B, obs_dim] float32
    reward: torch.Tensor  # [B] float32
    done: torch.Tensor  # [B] bool: terminated or truncated
    terminated: torch.Tensor  # [B] bool: a true terminal state (not a time limit)
    episode_return: torch.Tensor  # [B] float32, finished episodes only
    episode_length: torch.Tensor  # [B] float32, finished episodes only


class BatchedEnv:
    """Base class: ``num_envs`` environments stepped together as tensors on ``device``.

    Subclasses hold their whole state in tensors that are updated **in place**, draw
    randomness only from the ``generator`` passed to ``reset``/``step``, and consume the
    same number of random numbers on every step whatever happens, so a step is a pure
    function of (state, action, generator state) and can be captured in a CUDA graph.
    """

    obs_dim: int
    num_actions: int

    def __init__(self, num_envs: int, device: torch.device | str = "cpu") -> None:
        if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs <= 0:
            raise ValueError(f"num_envs must be a positive int, got {num_envs!r}")
        self.num_envs = num_envs
        self.device = torch.device(device)
        self.episode_return = torch.zeros(num_envs, device=self.device)
        self.episode_length = torch.zeros(num_envs, device=self.device)

    def reset(self, generator: torch.Generator) -> torch.Tensor:
        """Start a fresh episode in every environment; return the observations ``[B, obs_dim]``."""
        raise NotImplementedError

    def step(self, action: torch.Tensor, generator: torch.Generator) -> StepResult:
        """Advance every environment by one step with ``action`` (``[B]`` long)."""
        raise NotImplementedError

    def draw_step_noise(self, generator: torch.Generator) -> torch.Tensor:
        """The random numbers one :meth:`step` consumes, drawn from ``generator`` ahead of the step.

        With :meth:`step_with_noise`, an optional split of :meth:`step` (``step(a, g)`` equals
        ``step_with_noise(a, draw_step_noise(g))``): the second half is then a pure function of the state,
        the action and the noise, which a compiled region without RNG can hold (``agent.compiled_step``).
        """
        raise NotImplementedError

    def step_with_noise(self, action: torch.Tensor, noise: torch.Tensor) -> StepResult:
        """:meth:`step` with its random numbers given (from :meth:`draw_step_noise`)."""
        raise NotImplementedError

    def observe(self) -> torch.Tensor:
        """The current observations ``[B, obs_dim]`` without stepping."""
        raise NotImplementedError

    @property
    def longest_episode(self) -> int:
        """The most steps an episode can last (every episode has ended within this many steps of a reset)."""
        raise NotImplementedError

    def _state_names(self) -> tuple[str, ...]:
        return ("episode_return", "episode_length")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every state tensor (cloned), enough to continue the same trajectories after a restart."""
        return {name: getattr(self, name).detach().clone() for name in self._state_names()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (from :meth:`state_dict`) into this environment's tensors, in place."""
        missing = [name for name in self._state_names() if name not in state]
        if missing:
            raise KeyError(f"environment state is missing {missing}; got keys {sorted(state)}")
        for name in self._state_names():
            target = getattr(self, name)
            source = state[name]
            if source.shape != target.shape:
                raise ValueError(
                    f"environment state {name!r} has shape {tuple(source.shape)}, expected {tuple(target.shape)}"
                    " (HINT: num_envs must match the checkpoint's)"
                )
            target.copy_(source)

    def _finish(self, reward: torch.Tensor, done: torch.Tensor, terminated: torch.Tensor) -> StepResult:
        """Update episode accumulators in place; return them for finished episodes."""
        self.episode_return.add_(reward)
        self.episode_length.add_(1.0)
        finished_return = torch.where(done, self.episode_return, torch.zeros_like(reward))
        finished_length = torch.where(done, self.episode_length, torch.zeros_like(reward))
        keep = (~done).to(reward.dtype)
        self.episode_return.mul_(keep)
        self.episode_length.mul_(keep)
        return StepResult(self.observe(), reward, done, terminated, finished_return, finished_length)
