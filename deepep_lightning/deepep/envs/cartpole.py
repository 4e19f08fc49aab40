"""Batched CartPole with gymnasium's CartPole constants (500-step episodes) and Euler dynamics."""

from __future__ import annotations

import math

import torch

from deepep_lightning.deepep.envs.base import BatchedEnv, StepResult

__all__ = ["BatchedCartPole"]

GRAVITY = 9.8
MASS_CART = 1.0
MASS_POLE = 0.1
TOTAL_MASS = MASS_CART + MASS_POLE
HALF_POLE_LENGTH = 0.5
POLE_MASS_LENGTH = MASS_POLE * HALF_POLE_LENGTH
FORCE_MAG = 10.0
TAU = 0.02
THETA_THRESHOLD = 12 * 2 * math.pi / 360  # ±12°
X_THRESHOLD = 2.4
MAX_EPISODE_STEPS = 500
RESET_LOW, RESET_HIGH = -0.05, 0.05


class BatchedCartPole(BatchedEnv):
    """``num_envs`` CartPole environments as one ``[B, 4]`` state tensor.

    Dynamics, thresholds and rewards follow gymnasium's ``CartPoleEnv`` (``kinematics_integrator="euler"``):
    reward 1 on every step including the terminating one; terminated when ``|x| > 2.4`` or
    ``|θ| > 12°``; truncated after ``max_episode_steps`` (500). Both end the episode and auto-reset
    (see :class:`~deepep_lightning.deepep.envs.base.StepResult`); only termination is ``terminated``. The
    agent bootstraps through a truncation (the time limit is not part of the state, so treating it as
    a terminal would teach the critic values it cannot predict — Pardo et al., 2018); since the last
    observation is replaced by the next episode's first, that bootstrap uses the fresh start state's
    value, which for CartPole is close to the value of any balanced state.

    Args:
        num_envs: number of environments B.
        device: where the state lives.
        max_episode_steps: truncation length (500, gymnasium's CartPole).

    Example::

        env = BatchedCartPole(8)
        obs = env.reset(torch.Generator().manual_seed(0))
        result = env.step(torch.ones(8, dtype=torch.long), generator)
    """

    obs_dim = 4
    num_actions = 2

    def __init__(self, num_envs: int, device: torch.device | str = "cpu", max_episode_steps: int = MAX_EPISODE_STEPS):
        super().__init__(num_envs, device)
        if isinstance(max_episode_steps, bool) or not isinstance(max_episode_steps, int) or max_episode_steps <= 0:
            raise ValueError(f"max_episode_steps must be a positive int, got {max_episode_steps!r}")
        self.max_episode_steps = max_episode_steps
        self.state = torch.zeros(num_envs, 4, device=self.device)  # [B, (x, x_dot, theta, theta_dot)]

    @property
    def longest_episode(self) -> int:
        return self.max_episode_steps

    def _state_names(self) -> tuple[str, ...]:
        return ("state",) + super()._state_names()

    def _random_state(self, generator: torch.Generator) -> torch.Tensor:
        return self._reset_state(self._reset_uniform(generator))

    def _reset_uniform(self, generator: torch.Generator) -> torch.Tensor:
        return torch.rand(self.num_envs, 4, device=self.device, generator=generator)  # [B, 4]

    @staticmethod
    def _reset_state(uniform: torch.Tensor) -> torch.Tensor:
        """Reset states ``[B, 4]`` from uniforms in [0, 1): each coordinate in [RESET_LOW, RESET_HIGH)."""
        return RESET_LOW + (RESET_HIGH - RESET_LOW) * uniform

    def reset(self, generator: torch.Generator) -> torch.Tensor:
        self.state.copy_(self._random_state(generator))
        self.episode_return.zero_()
        self.episode_length.zero_()
        return self.observe()

    def observe(self) -> torch.Tensor:
        return self.state.clone()

    def step(self, action: torch.Tensor, generator: torch.Generator) -> StepResult:
        return self.step_with_noise(action, self.draw_step_noise(generator))

    def draw_step_noise(self, generator: torch.Generator) -> torch.Tensor:
        # The uniforms of the reset states, drawn every step (used or not) so RNG use never depends on the
        # data; step_with_noise scales them, so a compiled step holds that arithmetic too.
        return self._reset_uniform(generator)

    def step_with_noise(self, action: torch.Tensor, noise: torch.Tensor) -> StepResult:
        x, x_dot, theta, theta_dot = self.state.unbind(-1)
        force = torch.where(action == 1, FORCE_MAG, -FORCE_MAG).to(self.state.dtype)
        cos_theta, sin_theta = torch.cos(theta), torch.sin(theta)
        temp = (force + POLE_MASS_LENGTH * theta_dot.square() * sin_theta) / TOTAL_MASS
        theta_acc = (GRAVITY * sin_theta - cos_theta * temp) / (
            HALF_POLE_LENGTH * (4.0 / 3.0 - MASS_POLE * cos_theta.square() / TOTAL_MASS)
        )
        x_acc = temp - POLE_MASS_LENGTH * theta_acc * cos_theta / TOTAL_MASS
        next_state = torch.stack(
            (x + TAU * x_dot, x_dot + TAU * x_acc, theta + TAU * theta_dot, theta_dot + TAU * theta_acc), dim=-1
        )
        nx, ntheta = next_state[:, 0], next_state[:, 2]
        terminated = (nx < -X_THRESHOLD) | (nx > X_THRESHOLD) | (ntheta < -THETA_THRESHOLD) | (ntheta > THETA_THRESHOLD)
        truncated = self.episode_length + 1 >= self.max_episode_steps
        done = terminated | truncated
        reward = torch.ones(self.num_envs, device=self.device)
        self.state.copy_(torch.where(done.unsqueeze(-1), self._reset_state(noise), next_state))
        return self._finish(reward, done, terminated)
