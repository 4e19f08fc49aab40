import pytest
import torch

from deepep_lightning.deepep.envs import CueRecall


def _run_episode(env, policy, generator):
    obs = env.observe()
    first_cue = obs[:, : env.num_cues].argmax(-1)
    total = torch.zeros(env.num_envs)
    for _ in range(env.horizon):
        result = env.step(policy(obs, first_cue), generator)
        total += result.reward
        obs = result.obs
    return total, result


def test_remembering_the_cue_wins_and_memoryless_is_chance():
    generator = torch.Generator().manual_seed(0)
    env = CueRecall(4096, horizon=512, num_cues=2)
    env.reset(generator)
    total, last = _run_episode(env, lambda obs, cue: cue, generator)
    assert torch.all(total == 1.0) and last.done.all()
    assert torch.all(last.episode_length == 512)
    # A memoryless policy sees the same query observation whatever the cue: ~50 % right, return ~0.
    total, _ = _run_episode(env, lambda obs, cue: torch.zeros(obs.shape[0], dtype=torch.long), generator)
    assert abs(total.mean().item()) < 0.06


def test_observations_show_cue_only_first_and_query_only_last():
    generator = torch.Generator().manual_seed(1)
    env = CueRecall(8, horizon=4, num_cues=3)
    obs = env.reset(generator)
    assert torch.all(obs[:, :3].sum(-1) == 1) and torch.all(obs[:, 3] == 0)
    actions = torch.zeros(8, dtype=torch.long)
    obs = env.step(actions, generator).obs
    assert torch.all(obs == 0)
    obs = env.step(actions, generator).obs  # clock 2 of 0..3: blank
    assert torch.all(obs == 0)
    obs = env.step(actions, generator).obs  # clock 3: the query
    assert torch.all(obs[:, :3] == 0) and torch.all(obs[:, 3] == 1)
    result = env.step(actions, generator)
    assert result.done.all() and torch.all(result.obs[:, :3].sum(-1) == 1)  # next episode's cue


@pytest.mark.parametrize(
    "kwargs, message",
    [({"horizon": 1}, "horizon must be an int >= 2, got 1"), ({"num_cues": 1}, "num_cues must be an int >= 2, got 1")],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CueRecall(2, **kwargs)
