"""Tests for ``deepep_lightning/determinism/data.py``: per-sample streams and the seekable loader."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from deepep_lightning.determinism import data as data_module
from deepep_lightning.determinism.data import (
    SeededDataset,
    SeekableDataLoader,
    make_seekable,
    put_back_loader_states,
    take_loader_states,
)
from deepep_lightning.determinism.rng import seed_everything_from
from deepep_lightning.determinism.sampler import SampleKey, SeekableSampler


class _Noisy(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index), torch.rand(1).item(), float(np.random.rand())])


def _epoch(loader: DataLoader) -> torch.Tensor:
    return torch.cat(list(loader))


def test_per_sample_randomness_does_not_depend_on_workers() -> None:
    base = DataLoader(_Noisy(), batch_size=3, shuffle=True)
    zero, _ = make_seekable(base, seed=5)
    two, _ = make_seekable(DataLoader(_Noisy(), batch_size=3, shuffle=True, num_workers=2), seed=5)
    assert isinstance(zero, SeekableDataLoader)
    assert torch.equal(_epoch(zero), _epoch(two))
    reference = _epoch(zero)
    assert sorted(reference[:, 0].tolist()) == [float(i) for i in range(12)]
    assert reference[:, 0].tolist() != [float(i) for i in range(12)], "shuffle=True must shuffle"


def test_main_process_sample_seeding_does_not_touch_the_global_stream() -> None:
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    SeededDataset(_Noisy(), seed=1)[SampleKey(0, 3)]
    assert torch.equal(torch.rand(1), expected)


class _AllStreams(Dataset):
    """A sample drawing from torch, numpy and ``random``: what augmentation pipelines do."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index), torch.rand(1).item(), float(np.random.rand()), random.random()])


def _outer_draws() -> list[float]:
    return [torch.rand(1).item(), float(np.random.rand()), random.random()]


def _outer_draws_then_reseed() -> list[float]:
    """The outer stream's first draws from a fixed seed; the stream is then seeded again, ready to draw them."""
    seed_everything_from(3, "outer")
    draws = _outer_draws()
    seed_everything_from(3, "outer")
    return draws


def _count_forks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one whenever the data module enters ``fork_global_rng``."""
    forks: list[int] = []
    real_fork = data_module.fork_global_rng
    monkeypatch.setattr(data_module, "fork_global_rng", lambda: forks.append(1) or real_fork())
    return forks


def test_a_batch_forks_the_global_streams_once_and_seeds_each_sample_from_its_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dataset = SeededDataset(_AllStreams(), seed=1)
    keys = [SampleKey(0, index) for index in (7, 2, 9)]
    one_by_one = [dataset[key] for key in keys]
    expected = _outer_draws_then_reseed()
    forks = _count_forks(monkeypatch)
    batch = dataset.__getitems__(keys)
    assert len(forks) == 1
    assert all(torch.equal(a, b) for a, b in zip(batch, one_by_one))
    assert len({tuple(sample[1:].tolist()) for sample in batch}) == 3  # each sample its own stream
    assert _outer_draws() == expected  # torch, numpy and random: the training stream is not shifted
    loader, _ = make_seekable(DataLoader(_AllStreams(), batch_size=4, shuffle=True), seed=5)
    forks.clear()
    assert len(list(loader)) == 3 and len(forks) == 3  # the fetcher hands SeededDataset whole batches


def test_without_restoring_a_batch_leaves_the_last_samples_streams_and_the_same_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``restore_global_rng=False`` (what the callback asks for when it reseeds before every batch): no fork, the
    samples' bits are those of the forking dataset, and the global streams are left where the last sample's
    draws left them (the negative control of the fork: the outer draws differ)."""
    keys = [SampleKey(0, index) for index in (7, 2, 9)]
    forking = SeededDataset(_AllStreams(), seed=1).__getitems__(keys)
    expected = _outer_draws_then_reseed()
    forks = _count_forks(monkeypatch)
    batch = SeededDataset(_AllStreams(), seed=1, restore_global_rng=False).__getitems__(keys)
    assert forks == []
    assert all(torch.equal(a, b) for a, b in zip(batch, forking))
    left = _outer_draws()
    assert left != expected
    seed_everything_from(1, "sample", 0, 9)  # the last sample's streams, after its draws
    _AllStreams()[9]
    assert _outer_draws() == left
    loader, _ = make_seekable(DataLoader(_AllStreams(), batch_size=4, shuffle=True), seed=5, restore_global_rng=False)
    assert loader.dataset.restore_global_rng is False and len(list(loader)) == 3 and forks == []


def test_loader_state_seeks_mid_epoch() -> None:
    loader, _ = make_seekable(DataLoader(_Noisy(), batch_size=2, shuffle=True), seed=9)
    loader.sampler.set_epoch(1)
    iterator = iter(loader)
    full = [next(iterator) for _ in range(6)]
    loader.sampler.set_epoch(1)
    iterator = iter(loader)
    next(iterator), next(iterator)
    state = loader.state_dict()
    assert state == {"epoch": 1, "batches": 2}
    resumed, _ = make_seekable(DataLoader(_Noisy(), batch_size=2, shuffle=True), seed=9)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == 4 and all(torch.equal(a, b) for a, b in zip(full[2:], rest))
    # negative control: without the state the loader starts the epoch over
    fresh, _ = make_seekable(DataLoader(_Noisy(), batch_size=2, shuffle=True), seed=9)
    fresh.sampler.set_epoch(1)
    assert not torch.equal(next(iter(fresh)), full[2])


def test_unsupported_loaders_are_left_alone_with_a_reason() -> None:
    custom = DataLoader(_Noisy(), sampler=SeekableSampler(_Noisy()))
    same, reason = make_seekable(custom, seed=0)
    assert same is custom and "SeekableSampler" in reason
    data = [1, 2]
    assert make_seekable(data, seed=0) == (data, "it is a list, not a DataLoader")


def test_batch_size_none_loader_like_deepep() -> None:
    loader, reason = make_seekable(DataLoader(list(range(5)), batch_size=None, shuffle=False), seed=0)
    assert reason is None
    assert [int(x) for x in loader] == [0, 1, 2, 3, 4]


def test_stateful_dataloader_is_rebuilt_as_seekable() -> None:
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    original = stateful_dataloader.StatefulDataLoader(_Noisy(), batch_size=3, shuffle=True)
    loader, reason = make_seekable(original, seed=5)
    assert reason is None and isinstance(loader, SeekableDataLoader)
    plain, _ = make_seekable(DataLoader(_Noisy(), batch_size=3, shuffle=True), seed=5)
    assert torch.equal(_epoch(loader), _epoch(plain)), "the same order and per-sample streams as a DataLoader"
    sequential, _ = make_seekable(stateful_dataloader.StatefulDataLoader(_Noisy(), batch_size=3), seed=5)
    assert _epoch(sequential)[:, 0].tolist() == [float(i) for i in range(12)]


def test_stateful_dataloader_over_a_stateful_dataset_keeps_its_own_state() -> None:
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")

    class WithState(_Noisy):
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    original = stateful_dataloader.StatefulDataLoader(WithState(), batch_size=3, shuffle=True)
    same, reason = make_seekable(original, seed=5)
    assert same is original and "state_dict of its own" in reason


def test_own_loader_states_move_out_of_lightnings_list_and_back() -> None:
    class Stateful:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    own, foreign = Stateful(), Stateful()
    loaders = [foreign, [1, 2], own]  # the list (not stateful) holds no state in Lightning's list
    states = [{"foreign": 1}, {"own": 2}]
    checkpoint = {"loops": {"fit_loop": {"state_dict": {"combined_loader": list(states)}}}}
    taken = take_loader_states(checkpoint, loaders, lambda loader: loader is own)
    assert taken == {"positions": [1], "states": [{"own": 2}]}
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"foreign": 1}]
    put_back_loader_states(checkpoint, taken)
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == states
    # states that do not line up with the loaders are left where they are
    mismatched = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [{"a": 1}]}}}}
    assert take_loader_states(mismatched, loaders, lambda loader: loader is own) is None
    assert mismatched["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"a": 1}]
    only_own = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [{"own": 2}]}}}}
    assert take_loader_states(only_own, [own], lambda loader: loader is own) == {
        "positions": [0],
        "states": [{"own": 2}],
    }
    assert only_own["loops"]["fit_loop"]["state_dict"] == {}, "no empty list left behind, as Lightning writes it"
