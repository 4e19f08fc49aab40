import math

import pytest
import torch

from deepep_lightning.deepep.agent.targets import adapt_entropy_coef_, polyak_update_


def _pairs(seed=0):
    g = torch.Generator().manual_seed(seed)
    target = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    online = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g)]
    return target, online


@pytest.mark.parametrize("tau", [0.05, 0.5, 1.0])
def test_polyak_update_is_target_plus_tau_times_the_difference(tau):
    target, online = _pairs()
    expected = [t + tau * (o - t) for t, o in zip(target, online)]
    addresses = [t.data_ptr() for t in target]
    polyak_update_(target, online, tau)
    for got, want in zip(target, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert [t.data_ptr() for t in target] == addresses  # in place: a captured graph keeps its pointers


def test_polyak_update_with_tau_one_copies_and_a_small_tau_does_not():
    target, online = _pairs()
    polyak_update_(target, online, 1.0)
    assert all(torch.equal(t, o) for t, o in zip(target, online))
    target, online = _pairs()
    polyak_update_(target, online, 0.05)
    assert not any(torch.equal(t, o) for t, o in zip(target, online))


@pytest.mark.parametrize("tau", [0.0, -0.1, 1.5])
def test_polyak_update_refuses_tau_outside_zero_one(tau):
    target, online = _pairs()
    with pytest.raises(ValueError, match=rf"tau must be in \(0, 1\], got {tau}"):
        polyak_update_(target, online, tau)


def test_polyak_update_refuses_mismatched_lists():
    target, online = _pairs()
    with pytest.raises(ValueError, match="2 target tensors for 1 online"):
        polyak_update_(target, online[:1], 0.1)


def test_entropy_coefficient_moves_toward_its_target_and_stays_in_bounds():
    low, high = 1e-3, 0.1
    log_coef = torch.tensor(math.log(0.01))
    adapt_entropy_coef_(log_coef, torch.tensor(0.2), target_entropy=0.4, rate=0.5, low=low, high=high)
    assert log_coef.item() == pytest.approx(math.log(0.01) + 0.5 * 0.2)  # below target: larger bonus
    before = log_coef.item()
    adapt_entropy_coef_(log_coef, torch.tensor(0.6), target_entropy=0.4, rate=0.5, low=low, high=high)
    assert log_coef.item() < before  # above target: smaller bonus
    before = log_coef.item()
    adapt_entropy_coef_(log_coef, torch.tensor(0.4), target_entropy=0.4, rate=0.5, low=low, high=high)
    assert log_coef.item() == pytest.approx(before)  # at target: unchanged
    for _ in range(100):
        adapt_entropy_coef_(log_coef, torch.tensor(0.0), target_entropy=0.4, rate=0.5, low=low, high=high)
    assert log_coef.exp().item() == pytest.approx(high)
    for _ in range(100):
        adapt_entropy_coef_(log_coef, torch.tensor(0.69), target_entropy=0.4, rate=0.5, low=low, high=high)
    assert log_coef.exp().item() == pytest.approx(low)
