"""rank_state: the checkpoint entry, the world-size check and giving each rank its own state back."""

from __future__ import annotations

import pytest

from deepep_lightning.protocols import ROLLOUT_STATE_KEY
from deepep_lightning.strategies.rank_state import (
    WorldSizeMismatchError,
    apply_rank_state,
    build_rank_state,
    check_world_size,
)


def test_build_without_a_process_group_keeps_the_local_keys_only():
    checkpoint = {"callbacks": {"a": 1}, ROLLOUT_STATE_KEY: {"step": 3}, "state_dict": {}}
    state = build_rank_state(checkpoint, ("callbacks", ROLLOUT_STATE_KEY, "absent"), 1, seed=7)
    assert state["world_size"] == 1 and state["seed"] == 7
    assert state["per_rank"] == [{"callbacks": {"a": 1}, ROLLOUT_STATE_KEY: {"step": 3}}]


def test_apply_puts_back_this_ranks_copy_only_when_the_layout_matches():
    state = {"per_rank": [{ROLLOUT_STATE_KEY: 0}, {ROLLOUT_STATE_KEY: 1}]}
    checkpoint = {ROLLOUT_STATE_KEY: 0}
    assert apply_rank_state(checkpoint, state, rank=1, world_size=2) and checkpoint[ROLLOUT_STATE_KEY] == 1
    untouched = {ROLLOUT_STATE_KEY: 0}
    assert not apply_rank_state(untouched, state, rank=0, world_size=3)  # negative control
    assert untouched == {ROLLOUT_STATE_KEY: 0}


def test_world_size_check():
    check_world_size({"world_size": 2}, 2)
    check_world_size({}, 2)  # an entry without a size (older format) is not refused
    with pytest.raises(
        WorldSizeMismatchError, match=r"world_size=8, this run has world_size=2.*devices x num_nodes = 8"
    ):
        check_world_size({"world_size": 8}, 2)
