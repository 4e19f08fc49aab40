"""Tests for ``deepep_lightning/determinism/sampler.py``: order = f(seed, epoch, rank), O(1) seek."""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from deepep_lightning.determinism.sampler import SampleKey, SeekableSampler

_DATA = list(range(10))


def test_order_is_a_pure_function_of_seed_and_epoch() -> None:
    a, b = SeekableSampler(_DATA, seed=3), SeekableSampler(_DATA, seed=3)
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b) and sorted(a) == _DATA
    b.set_epoch(3)
    assert list(a) != list(b), "negative control: another epoch must give another order"
    assert list(SeekableSampler(_DATA, seed=4)) != list(SeekableSampler(_DATA, seed=3))


def test_seek_starts_mid_epoch_once() -> None:
    sampler = SeekableSampler(_DATA, seed=1)
    full = list(sampler)
    sampler.seek(4)
    assert list(sampler) == full[4:]
    assert list(sampler) == full, "a seek applies to one iterator only"


def test_state_dict_round_trip_and_keys() -> None:
    sampler = SeekableSampler(_DATA, seed=1, emit_keys=True)
    sampler.set_epoch(5)
    sampler.seek(7)
    other = SeekableSampler(_DATA, seed=1, emit_keys=True)
    other.load_state_dict(sampler.state_dict())
    keys = list(other)
    assert keys == list(sampler) and all(isinstance(k, SampleKey) and k.epoch == 5 for k in keys) and len(keys) == 3


def test_ranks_partition_the_epoch_and_it_is_a_distributed_sampler() -> None:
    shards = [list(SeekableSampler(_DATA, seed=2, num_replicas=3, rank=r)) for r in range(3)]
    assert all(len(s) == 4 for s in shards)  # padded like DistributedSampler
    assert set(sum(shards, [])) == set(_DATA)
    assert isinstance(SeekableSampler(_DATA), DistributedSampler)  # Lightning does not re-wrap it


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"rank": 2, "num_replicas": 2}, "rank"), ({"num_replicas": 0}, "num_replicas")],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SeekableSampler(_DATA, **kwargs)


def test_bad_seek() -> None:
    with pytest.raises(ValueError, match="position"):
        SeekableSampler(_DATA).seek(11)
