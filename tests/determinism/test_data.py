"""Tests for ``deepep_lightning/determinism/data.py``: per-sample streams and the seekable loader."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from deepep_lightning.determinism.data import SeededDataset, SeekableDataLoader, make_seekable
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
