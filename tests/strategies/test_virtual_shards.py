"""VirtualShardSampler and the world-size-invariant mode's checks (in one process)."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.strategies import DeterministicDDPStrategy
from deepep_lightning.strategies.virtual_shards import VirtualShardSampler


def _sampler(**overrides) -> VirtualShardSampler:
    kwargs = dict(virtual_world_size=2, num_replicas=1, rank=0, batch_size=4, seed=3, shuffle=True)
    kwargs.update(overrides)
    return VirtualShardSampler(range(32), **kwargs)


def test_one_process_interleaves_the_shards_of_two_virtual_ranks():
    sampler = _sampler()
    sampler.set_epoch(1)
    order = list(sampler)
    shards = [DeterministicDDPStrategy.shard(32, 3, 1, rank, 2) for rank in (0, 1)]
    expected = [i for start in range(0, 16, 4) for shard in shards for i in shard[start : start + 4]]
    assert order == expected and len(sampler) == 32
    # negative control: the plain one-process order is a different sequence of micro-batches
    assert order != DeterministicDDPStrategy.shard(32, 3, 1, 0, 1)


def test_with_as_many_processes_as_virtual_ranks_it_is_the_plain_shard():
    sampler = _sampler(num_replicas=2, rank=1)
    sampler.set_epoch(0)
    assert list(sampler) == DeterministicDDPStrategy.shard(32, 3, 0, 1, 2)


def test_invalid_partitions_are_refused():
    with pytest.raises(ValueError, match="multiple of the world size"):
        _sampler(virtual_world_size=3, num_replicas=2)
    with pytest.raises(ValueError, match="batch_size=5.*HINT"):
        _sampler(batch_size=5)


def test_virtual_ranks_and_micro_batches(quiet_trainer):
    strategy = quiet_trainer(
        strategy=DeterministicDDPStrategy(virtual_world_size=4),
    ).strategy
    assert strategy.micro_batches_per_step == 4
    assert [strategy.virtual_rank(i) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    plain = quiet_trainer(
        devices=2,
        strategy="ddp_deterministic",
    ).strategy
    assert plain.micro_batches_per_step == 1 and plain.virtual_rank(5) == 0  # by default: the rank itself


def test_accumulation_must_match_the_partition(quiet_trainer):
    def trainer(accumulate: int) -> Trainer:
        return quiet_trainer(
            strategy=DeterministicDDPStrategy(virtual_world_size=2),
            accumulate_grad_batches=accumulate,
        )

    good = trainer(2)
    good.strategy.check_partition(good)  # negative control
    bad = trainer(1)
    with pytest.raises(MisconfigurationException, match=r"accumulate_grad_batches.*= 2.*got 1"):
        bad.strategy.check_partition(bad)


@pytest.mark.parametrize("value", [0, 1.5, True])
def test_bad_virtual_world_size(value):
    with pytest.raises(MisconfigurationException, match="virtual_world_size"):
        DeterministicDDPStrategy(virtual_world_size=value)
