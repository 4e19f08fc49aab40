import math

import pytest
import torch

from deepep_lightning.deepep.envs import BatchedCartPole, make_env


def _gymnasium_euler_step(state, action):
    """gymnasium CartPoleEnv.step (euler), written out by hand for one environment."""
    x, x_dot, theta, theta_dot = state
    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    total_mass = masspole + masscart
    polemass_length = masspole * length
    force = force_mag if action == 1 else -force_mag
    costheta, sintheta = math.cos(theta), math.sin(theta)
    temp = (force + polemass_length * theta_dot**2 * sintheta) / total_mass
    thetaacc = (gravity * sintheta - costheta * temp) / (length * (4.0 / 3.0 - masspole * costheta**2 / total_mass))
    xacc = temp - polemass_length * thetaacc * costheta / total_mass
    return [x + tau * x_dot, x_dot + tau * xacc, theta + tau * theta_dot, theta_dot + tau * thetaacc]


def test_step_matches_hand_computed_euler_step():
    env = BatchedCartPole(3)
    start = torch.tensor([[0.01, -0.2, 0.03, 0.4], [-0.5, 0.3, -0.1, -0.2], [1.0, 0.1, 0.15, 0.5]])
    env.state.copy_(start)
    actions = torch.tensor([1, 0, 1])
    result = env.step(actions, torch.Generator().manual_seed(0))
    for i in range(3):
        expected = _gymnasium_euler_step(start[i].double().tolist(), int(actions[i]))
        assert torch.allclose(result.obs[i].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)
    assert result.reward.tolist() == [1.0, 1.0, 1.0]
    assert not result.done.any()


def test_reset_is_uniform_in_small_box_and_seeded():
    a = BatchedCartPole(256).reset(torch.Generator().manual_seed(1))
    b = BatchedCartPole(256).reset(torch.Generator().manual_seed(1))
    c = BatchedCartPole(256).reset(torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.abs().max() <= 0.05 and a.abs().max() > 0.04


@pytest.mark.parametrize("column, value", [(0, 2.39), (0, -2.39), (2, 0.2), (2, -0.2)])
def test_termination_at_position_and_angle_limits(column, value):
    env = BatchedCartPole(1)
    state = torch.zeros(1, 4)
    state[0, column] = value
    velocity = 1 if column == 0 else 3
    state[0, velocity] = 5.0 if value > 0 else -5.0  # moving outward: crosses ±2.4 or ±12° this step
    env.state.copy_(state)
    env.episode_length.fill_(7)
    env.episode_return.fill_(7)
    result = env.step(torch.tensor([1 if value > 0 else 0]), torch.Generator().manual_seed(0))
    assert result.done.item()
    assert result.reward.item() == 1.0  # the terminating step is rewarded, as in gymnasium
    assert result.episode_return.item() == 8.0 and result.episode_length.item() == 8.0
    # auto-reset: the returned observation already starts the next episode
    assert result.obs.abs().max() <= 0.05
    assert env.episode_return.item() == 0.0 and env.episode_length.item() == 0.0


def test_inside_limits_does_not_terminate():
    env = BatchedCartPole(1)
    env.state.copy_(torch.tensor([[2.3, 0.0, 0.19, 0.0]]))
    result = env.step(torch.tensor([0]), torch.Generator().manual_seed(0))
    assert not result.done.item()


def test_truncation_after_max_episode_steps():
    env = BatchedCartPole(2, max_episode_steps=5)
    generator = torch.Generator().manual_seed(0)
    env.reset(generator)
    env.state.zero_()  # perfectly balanced: alternate pushes never fall in 5 steps
    dones = []
    for t in range(5):
        dones.append(env.step(torch.tensor([t % 2, t % 2]), generator).done.tolist())
    assert dones[:4] == [[False, False]] * 4 and dones[4] == [True, True]


def test_truncation_is_done_but_not_terminated_and_falling_is_both():
    generator = torch.Generator().manual_seed(0)
    env = BatchedCartPole(2, max_episode_steps=3)
    env.state.copy_(torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.39, 5.0, 0.0, 0.0]]))
    env.episode_length.copy_(torch.tensor([2.0, 0.0]))  # env 0 is on its last allowed step
    result = env.step(torch.tensor([1, 1]), generator)
    assert result.done.tolist() == [True, True]
    assert result.terminated.tolist() == [False, True]


def test_state_dict_round_trip_continues_identically():
    generator = torch.Generator().manual_seed(3)
    env = BatchedCartPole(4)
    env.reset(generator)
    saved, saved_rng = env.state_dict(), generator.get_state()
    actions = torch.tensor([0, 1, 1, 0])
    first = [env.step(actions, generator).obs for _ in range(20)]
    env.load_state_dict(saved)
    generator.set_state(saved_rng)
    second = [env.step(actions, generator).obs for _ in range(20)]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="num_envs must be a positive int, got 0"):
        BatchedCartPole(0)
    with pytest.raises(ValueError, match="env must be one of .*'cartpole'.*got 'pong'"):
        make_env("pong", 2)
    with pytest.raises(ValueError, match="env_kwargs"):
        make_env("cartpole", 2, nonsense=1)
    env = BatchedCartPole(2)
    with pytest.raises(ValueError, match="num_envs must match"):
        env.load_state_dict(BatchedCartPole(3).state_dict())
