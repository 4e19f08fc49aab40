"""RollingEpisodeReturn: the mean of the last N finished episodes, on the device, fixed-shape and exact."""

import pytest
import torch

from deepep_lightning.deepep.episode_return import RollingEpisodeReturn


def _random_rollouts(steps, generator, shape=(4, 3)):
    for step in range(steps):
        dones = torch.rand(shape, generator=generator) < (0.9 if step % 3 == 0 else 0.2)
        returns = torch.randint(0, 500, shape, generator=generator).float()
        yield returns, dones


def test_mean_of_the_last_window_episodes_in_time_major_order():
    rolling = RollingEpisodeReturn(window=5)
    assert torch.isnan(rolling.compute())  # no episode finished yet
    finished = []
    for returns, dones in _random_rollouts(40, torch.Generator().manual_seed(0)):
        rolling.update(returns, dones)
        finished += returns.reshape(-1)[dones.reshape(-1)].tolist()  # [T, B] flattened: time-major
        if finished:
            assert rolling.compute().item() == pytest.approx(sum(finished[-5:]) / len(finished[-5:]), rel=1e-6)
    assert int(rolling.count) == len(finished) > 5


def test_more_episodes_in_one_rollout_than_the_window_keeps_the_last_ones():
    rolling = RollingEpisodeReturn(window=3)
    returns = torch.arange(1.0, 9.0).reshape(4, 2)  # time-major order 1..8
    rolling.update(returns, torch.ones(4, 2, dtype=torch.bool))
    assert rolling.compute().item() == pytest.approx((6 + 7 + 8) / 3)
    # negative control: the window of 8 sees every one of them
    wide = RollingEpisodeReturn(window=8)
    wide.update(returns, torch.ones(4, 2, dtype=torch.bool))
    assert wide.compute().item() == pytest.approx(4.5)


def test_state_is_in_the_state_dict_and_restores_the_figure():
    rolling, twin = RollingEpisodeReturn(4), RollingEpisodeReturn(4)
    for returns, dones in _random_rollouts(6, torch.Generator().manual_seed(1)):
        rolling.update(returns, dones)
    twin.load_state_dict(rolling.state_dict())
    assert torch.equal(twin.compute(), rolling.compute()) and int(twin.count) > 0
    assert torch.isnan(RollingEpisodeReturn(4).compute())  # negative control: a fresh one reports no figure


@pytest.mark.parametrize("window", [0, -1, 2.5, True])
def test_bad_window_is_refused_by_name(window):
    with pytest.raises(ValueError, match=rf"window=.*{window!r}"):
        RollingEpisodeReturn(window)
