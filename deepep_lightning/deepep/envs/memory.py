"""A long-horizon memory task: recall the first cue at the end of the episode."""

from __future__ import annotations

import torch

from deepep_lightning.deepep.envs.base import BatchedEnv, StepResult

__all__ = ["CueRecall"]


class CueRecall(BatchedEnv):
    """Episodes of ``horizon`` steps; step 0 shows one of ``num_cues`` cues, the last step asks for it.

    Observation ``[num_cues + 1]``: the cue one-hot on the first step (zeros afterwards) and a query
    flag on the last step. Actions are ``num_cues`` choices. Reward is 0 until the query step, then
    +1 for the cue shown on step 0 and -1 otherwise. A memoryless policy sees the same observation on
    every query step whatever the cue, so it is right 1/num_cues of the time (expected return
    ``2/num_cues - 1``, 0 for two cues); solving it needs memory across ``horizon - 1`` blank steps.

    All environments share the episode clock (episodes have fixed length and start together), so a
    rollout of ``horizon`` steps aligned with the clock holds whole episodes.

    Args:
        num_envs: number of environments B.
        device: where the state lives.
        horizon: episode length in steps, >= 2 (512 and more are fine).
        num_cues: number of distinct cues (and actions), >= 2.
    """

    def __init__(self, num_envs: int, device: torch.device | str = "cpu", horizon: int = 64, num_cues: int = 2):
        super().__init__(num_envs, device)
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 2:
            raise ValueError(f"horizon must be an int >= 2, got {horizon!r}")
        if isinstance(num_cues, bool) or not isinstance(num_cues, int) or num_cues < 2:
            raise ValueError(f"num_cues must be an int >= 2, got {num_cues!r}")
        self.horizon = horizon
        self.num_cues = num_cues
        self.obs_dim = num_cues + 1
        self.num_actions = num_cues
        self.cue = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.clock = torch.zeros(num_envs, dtype=torch.long, device=self.device)

    @property
    def longest_episode(self) -> int:
        return self.horizon

    def _state_names(self) -> tuple[str, ...]:
        return ("cue", "clock") + super()._state_names()

    def _draw_cue(self, generator: torch.Generator) -> torch.Tensor:
        return self._cue(self._cue_uniform(generator))

    def _cue_uniform(self, generator: torch.Generator) -> torch.Tensor:
        return torch.rand(self.num_envs, device=self.device, generator=generator)  # [B]

    def _cue(self, uniform: torch.Tensor) -> torch.Tensor:
        """Cues ``[B]`` (long) from uniforms in [0, 1), each of the ``num_cues`` equally likely."""
        return (uniform * self.num_cues).long().clamp(max=self.num_cues - 1)

    def reset(self, generator: torch.Generator) -> torch.Tensor:
        self.cue.copy_(self._draw_cue(generator))
        self.clock.zero_()
        self.episode_return.zero_()
        self.episode_length.zero_()
        return self.observe()

    def observe(self) -> torch.Tensor:
        first = (self.clock == 0).unsqueeze(-1)
        cue_one_hot = torch.nn.functional.one_hot(self.cue, self.num_cues).float() * first
        query = (self.clock == self.horizon - 1).float().unsqueeze(-1)
        return torch.cat((cue_one_hot, query), dim=-1)

    def step(self, action: torch.Tensor, generator: torch.Generator) -> StepResult:
        return self.step_with_noise(action, self.draw_step_noise(generator))

    def draw_step_noise(self, generator: torch.Generator) -> torch.Tensor:
        # the uniform of the next episode's cue [B], drawn every step so RNG use never depends on the data;
        # step_with_noise turns it into the cue, so a compiled step holds that arithmetic too
        return self._cue_uniform(generator)

    def step_with_noise(self, action: torch.Tensor, noise: torch.Tensor) -> StepResult:
        is_query = self.clock == self.horizon - 1
        correct = (action == self.cue).float()
        reward = torch.where(is_query, 2.0 * correct - 1.0, torch.zeros_like(correct))
        done = is_query
        self.cue.copy_(torch.where(done, self._cue(noise), self.cue))
        self.clock.copy_(torch.where(done, torch.zeros_like(self.clock), self.clock + 1))
        return self._finish(reward, done, done)  # the query step is a true end
