"""``seed_everything_from``'s fast path (no ``torch.manual_seed``) and the strategy's per-step stream."""

from __future__ import annotations

import random
import traceback

import numpy as np
import pytest
import torch

from deepep_lightning.determinism import rng
from deepep_lightning.determinism.rng import seed_everything_from
from deepep_lightning.determinism.streams import derive_seed


def _reference_seed(seed: int, *keys) -> int:
    """What seed_everything_from promises, the slow way: torch.manual_seed seeds every device type."""
    derived = derive_seed(seed, *keys)
    torch.manual_seed(derived)
    np.random.seed(derived & (2**32 - 1))
    random.seed(derived)
    return derived


def _draws() -> tuple:
    cuda = torch.rand(4, device="cuda").cpu() if torch.cuda.is_available() else None
    return (
        torch.get_rng_state(),
        torch.rand(4),
        np.random.get_state()[1].copy(),
        np.random.rand(3),
        random.random(),
        cuda,
    )


def _assert_same(first: tuple, second: tuple) -> None:
    assert torch.equal(first[0], second[0])
    assert torch.equal(first[1], second[1])
    assert np.array_equal(first[2], second[2]) and np.array_equal(first[3], second[3])
    assert first[4] == second[4]
    if first[5] is not None:
        assert torch.equal(first[5], second[5])


@pytest.mark.parametrize("keys", [("micro", 0, 0), ("micro", 1, 12345), ("anything", 7)])
def test_same_states_as_torch_manual_seed(keys):
    assert seed_everything_from(3, *keys) == _reference_seed(3, *keys)
    _reference_seed(3, *keys)
    reference = _draws()
    torch.manual_seed(999)  # move every stream away in between
    np.random.seed(999)
    random.seed(999)
    seed_everything_from(3, *keys)
    _assert_same(_draws(), reference)


def test_different_keys_give_different_streams():  # negative control: the comparison above can fail
    seed_everything_from(3, "micro", 0, 1)
    first = _draws()
    seed_everything_from(3, "micro", 1, 1)
    with pytest.raises(AssertionError):
        _assert_same(_draws(), first)


def test_does_not_capture_the_stack(monkeypatch):
    if not rng._only_cpu_and_cuda():
        pytest.skip("another device type is present: seed_everything_from uses torch.manual_seed")
    calls = []
    monkeypatch.setattr(traceback, "format_stack", lambda *a, **k: calls.append(1) or [])
    seed_everything_from(0, "micro", 0, 0)
    assert calls == []
    _reference_seed(0, "micro", 0, 0)  # control: torch.manual_seed captures it (uninitialised XPU/MTIA)
    assert calls, "torch.manual_seed no longer captures the stack: the fast path may no longer be needed"


def test_uses_torch_manual_seed_with_another_device_type(monkeypatch):
    monkeypatch.setattr(rng, "_only_cpu_and_cuda", lambda: False)
    calls = []
    monkeypatch.setattr(torch, "manual_seed", lambda seed: calls.append(seed))
    derived = seed_everything_from(4, "micro", 1, 2)
    assert calls == [derived]


def test_strategy_step_draws_the_stream_of_seed_everything_from(monkeypatch):
    from types import SimpleNamespace

    from lightning.pytorch.strategies.strategy import Strategy

    from deepep_lightning.strategies import DeterministicDDPStrategy

    strategy = DeterministicDDPStrategy(seed=11)
    strategy.seed = 11
    trainer = SimpleNamespace(global_step=5)
    module = SimpleNamespace(_trainer=trainer, trainer=trainer)
    monkeypatch.setattr(DeterministicDDPStrategy, "lightning_module", property(lambda self: module))
    monkeypatch.setattr(Strategy, "training_step", lambda self, *args, **kwargs: _draws())
    drawn = strategy.training_step(None, 0)  # what the module's step would draw
    _reference_seed(11, "micro", 0, 5)  # the stream the strategy promises: (seed, "micro", rank, step)
    _assert_same(drawn, _draws())
