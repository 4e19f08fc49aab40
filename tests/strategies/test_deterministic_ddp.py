"""DeterministicDDPStrategy in one process: registration, arguments, sampler seeds, fingerprint, resume checks.

The multi-process behaviour (bitwise runs, shards, per-rank seeds, lockstep rollback, refused
resume) is in ``test_deterministic_ddp_multiprocess.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning import _lightning_compat
from deepep_lightning.determinism.streams import derive_seed
from deepep_lightning.protocols import ROLLOUT_STATE_KEY
from deepep_lightning.strategies import CHECKPOINT_KEY, DeterministicDDPStrategy, WorldSizeMismatchError


@pytest.fixture
def make_trainer(quiet_trainer):
    def make(devices: int = 2, strategy: object = "ddp_deterministic") -> Trainer:
        # constructing a Trainer does not launch processes: the strategy is set up but not started
        return quiet_trainer(devices=devices, strategy=strategy)

    return make


def test_registered_by_name_and_idempotent(make_trainer):
    assert StrategyRegistry["ddp_deterministic"]["strategy"] is DeterministicDDPStrategy
    DeterministicDDPStrategy.register_strategies(StrategyRegistry)  # replaces the entry instead of raising
    trainer = make_trainer()
    assert isinstance(trainer.strategy, DeterministicDDPStrategy)
    assert trainer.world_size == 2


def test_ddp_arguments_are_pinned_and_recorded(make_trainer):
    strategy = DeterministicDDPStrategy(seed=5, bucket_cap_mb=50, static_graph=True)
    assert _lightning_compat.ddp_kwargs(strategy) == {
        "bucket_cap_mb": 50,
        "gradient_as_bucket_view": True,
        "static_graph": True,
        "find_unused_parameters": False,
    }
    record = make_trainer(strategy=strategy).strategy.fingerprint()
    assert record["ddp.bucket_cap_mb"] == "50"
    assert record["ddp.static_graph"] == "True"
    assert record["ddp.world_size"] == "2"
    assert json.loads(record["ddp.rank_seeds"]) == [derive_seed(5, "rank", 0), derive_seed(5, "rank", 1)]


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"seed": -1}, "seed"),
        ({"seed": True}, "seed"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
        ({"nccl_algorithm": "NVLS"}, "nccl_algorithm"),
        ({"nccl_protocol": "fast"}, "nccl_protocol"),
        ({"static_graph": "yes"}, "static_graph"),
        ({"allow_world_size_change": 1}, "allow_world_size_change"),
        ({"per_rank_checkpoint_keys": "callbacks"}, "per_rank_checkpoint_keys"),
    ],
)
def test_bad_arguments_are_named(kwargs, argument):
    with pytest.raises(MisconfigurationException, match=argument) as error:
        DeterministicDDPStrategy(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(error.value)


def test_rank_local_keys_default_to_callbacks_and_the_rollout_state():
    assert DeterministicDDPStrategy().per_rank_checkpoint_keys == ("callbacks", ROLLOUT_STATE_KEY)
    assert DeterministicDDPStrategy(per_rank_checkpoint_keys=["callbacks"]).per_rank_checkpoint_keys == ("callbacks",)


def test_sampler_seed_derived_from_the_run_seed(make_trainer):
    strategy = make_trainer(strategy=DeterministicDDPStrategy(seed=11)).strategy
    kwargs = strategy.distributed_sampler_kwargs
    assert kwargs == {"num_replicas": 2, "rank": 0, "seed": derive_seed(11, "sampler") >> 1}
    other = make_trainer(strategy=DeterministicDDPStrategy(seed=12)).strategy
    assert other.distributed_sampler_kwargs["seed"] != kwargs["seed"]  # negative control


def test_shard_is_a_pure_function_that_partitions_each_epoch():
    shards = {
        (epoch, rank): DeterministicDDPStrategy.shard(30, 7, epoch, rank, 3) for epoch in (0, 1) for rank in range(3)
    }
    for epoch in (0, 1):
        parts = [shards[(epoch, rank)] for rank in range(3)]
        assert sorted(sum(parts, [])) == list(range(30))  # disjoint and covering
    assert shards[(0, 0)] != shards[(1, 0)]  # set_epoch changes the order
    assert DeterministicDDPStrategy.shard(30, 7, 0, 0, 3) == shards[(0, 0)]
    assert DeterministicDDPStrategy.shard(30, 8, 0, 0, 3) != shards[(0, 0)]  # negative control: the seed matters


def test_run_seed_follows_the_callbacks_rule(monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert DeterministicDDPStrategy(seed=3).run_seed == 3
    monkeypatch.setenv("PL_GLOBAL_SEED", "42")
    assert DeterministicDDPStrategy().run_seed == 42
    assert DeterministicDDPStrategy(seed=3).run_seed == 3  # explicit wins


def test_resume_with_another_world_size_is_refused(make_trainer):
    strategy = make_trainer().strategy
    strategy.check_resume({"world_size": 2})  # negative control: the same size resumes
    with pytest.raises(WorldSizeMismatchError, match=r"world_size=4.*world_size=2.*HINT"):
        strategy.check_resume({"world_size": 4})
    lenient = make_trainer(strategy=DeterministicDDPStrategy(allow_world_size_change=True)).strategy
    with pytest.warns(UserWarning, match="world_size=4"):
        lenient.check_resume({"world_size": 4})


def test_load_checkpoint_gives_each_rank_its_own_state(tmp_path, make_trainer):
    strategy = make_trainer().strategy
    path = tmp_path / "fake.ckpt"
    per_rank = [{ROLLOUT_STATE_KEY: {"rank": 0}}, {ROLLOUT_STATE_KEY: {"rank": 1}}]
    torch.save(
        {ROLLOUT_STATE_KEY: {"rank": 0}, CHECKPOINT_KEY: {"world_size": 2, "seed": None, "per_rank": per_rank}}, path
    )
    loaded = strategy.load_checkpoint(path)
    assert loaded[ROLLOUT_STATE_KEY] == {"rank": 0}  # this process is rank 0
    strategy.cluster_environment.set_global_rank(1)  # also sets rank_zero_only.rank: put it back
    try:
        assert strategy.load_checkpoint(path)[ROLLOUT_STATE_KEY] == {"rank": 1}
    finally:
        strategy.cluster_environment.set_global_rank(0)
    torch.save({ROLLOUT_STATE_KEY: {"rank": 0}}, path)
    with pytest.warns(UserWarning, match="no world-size record"):
        strategy.load_checkpoint(path)
