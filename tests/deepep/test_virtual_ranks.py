"""DeepEP's virtual ranks: per-virtual-rank environments, recurrent state and checkpoint entries."""

from __future__ import annotations

import pytest
import torch

from deepep_lightning.deepep import DeepEPModule
from deepep_lightning.deepep.config import grouped

SIZES = {"num_envs": 3, "rollout_length": 4, "hidden_size": 8, "fused_value_head": False}


def _module_with_virtual_ranks(first: int, per_process: int) -> DeepEPModule:
    module = DeepEPModule(**grouped(name="cartpole", seed=7, **SIZES))
    module.ensure_rollout_state(virtual_ranks=(first, per_process))
    return module


def test_each_virtual_rank_has_its_own_environments_keyed_by_the_virtual_rank():
    two = _module_with_virtual_ranks(0, 2)
    other_process = _module_with_virtual_ranks(1, 1)  # virtual rank 1 on the second of two processes
    assert [slot.rank for slot in two.rollouts.virtual.states] == [0, 1]
    states = [slot.env.state_dict() for slot in two.rollouts.virtual.states]
    assert any(not torch.equal(states[0][k], states[1][k]) for k in states[0])  # virtual ranks differ
    alone = other_process.rollouts.virtual.states[0].env.state_dict()
    assert all(torch.equal(alone[k], states[1][k]) for k in alone)  # the same virtual rank: the same start


def test_rollout_state_round_trips_per_virtual_rank():
    source = _module_with_virtual_ranks(2, 2)
    source.rollouts.virtual.states[1].hidden.fill_(0.5)
    for state in source.rollouts.virtual.states:
        state.step = 9
    state = source.rollout_state_dict()
    assert sorted(state["virtual"]) == [2, 3] and state["rollout_step"] == 9
    target = _module_with_virtual_ranks(2, 2)
    target.load_rollout_state_dict(state)
    assert target.rollout_step == 9
    targets = target.rollouts.virtual.states
    assert torch.equal(targets[1].hidden, source.rollouts.virtual.states[1].hidden)
    assert not torch.equal(targets[0].hidden, targets[1].hidden)  # rank 2 keeps its own


def test_rollout_state_of_other_virtual_ranks_is_refused():
    state = _module_with_virtual_ranks(0, 2).rollout_state_dict()
    with pytest.raises(ValueError, match=r"virtual ranks \[0, 1\].*virtual ranks \[2, 3\].*virtual_world_size"):
        _module_with_virtual_ranks(2, 2).load_rollout_state_dict(state)
    plain = DeepEPModule(**grouped(name="cartpole", seed=7, **SIZES))
    plain.ensure_rollout_state()  # no trainer: the default path, one rollout
    with pytest.raises(ValueError, match="virtual ranks None"):
        _module_with_virtual_ranks(0, 2).load_rollout_state_dict(plain.rollout_state_dict())
