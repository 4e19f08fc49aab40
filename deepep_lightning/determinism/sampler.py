"""A shuffled (or sequential) sampler whose order is a pure function of (seed, epoch), with O(1) seek.

``torch.utils.data.RandomSampler`` draws its permutation from the global torch RNG when the
iterator starts, so a resumed run cannot rebuild it without replaying; ``DistributedSampler``
seeds from ``seed + epoch`` but cannot start in the middle of an epoch. :class:`SeekableSampler`
does both: the permutation of epoch ``e`` is ``randperm(n, generator=derive_seed(seed, "order", e))``
and :meth:`seek` makes the next iterator start at any position of this rank's share. It subclasses
``DistributedSampler`` so Lightning keeps it under DDP instead of wrapping it again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, NamedTuple, cast

import torch
from torch.utils.data import Dataset, DistributedSampler

from deepep_lightning import _checks
from deepep_lightning.determinism.streams import derive_seed

__all__ = ["SampleKey", "SeekableSampler"]


class SampleKey(NamedTuple):
    """What :class:`SeekableSampler` yields with ``emit_keys=True``: the sample and its epoch.

    :class:`~deepep_lightning.determinism.data.SeededDataset` derives the sample's random stream
    from it, so augmentation does not depend on which worker, or how many, load the sample.
    """

    epoch: int
    index: int  # type: ignore[assignment]  # shadows tuple.index, as the field is named


class SeekableSampler(DistributedSampler):
    """Order of epoch ``e`` = pure function of ``(seed, e)``; one rank's share; seekable.

    Args:
        data_source: the dataset (only its length is used).
        seed: run seed; the order is ``derive_seed(seed, "order", epoch)``.
        shuffle: permute (``True``) or keep ``0..n-1`` (``False``).
        num_replicas: number of ranks sharing the data (1 without DDP).
        rank: this rank (``0 <= rank < num_replicas``).
        drop_last: drop the tail instead of padding so every rank gets the same count.
        emit_keys: yield :class:`SampleKey` ``(epoch, index)`` instead of plain indices.

    Raises:
        ValueError: ``rank`` is outside ``[0, num_replicas)`` or ``num_replicas < 1``.

    Example::

        sampler = SeekableSampler(dataset, seed=7)
        sampler.set_epoch(3)
        sampler.seek(128)  # the next iterator starts at the 129th sample of epoch 3
    """

    def __init__(
        self,
        data_source: Sized,
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        emit_keys: bool = False,
    ) -> None:
        _checks.positive_int(None, "num_replicas", num_replicas, error=ValueError)
        _checks.int_in_range(None, "rank", rank, 0, num_replicas, high_inclusive=False, error=ValueError)
        # num_replicas and rank are explicit, so the parent never asks torch.distributed.
        super().__init__(
            cast("Dataset[Any]", data_source),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.emit_keys = emit_keys
        self._start = 0

    def order(self, epoch: int) -> list[int]:
        """The whole epoch's order for this rank (a pure function of ``(seed, epoch, rank)``)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, "order", int(epoch)))
            indices = torch.randperm(n, generator=generator).tolist()
        else:
            indices = list(range(n))
        if self.drop_last:
            indices = indices[: self.total_size]
        elif len(indices) < self.total_size:
            padding = self.total_size - len(indices)
            indices += (indices * (padding // max(len(indices), 1) + 1))[:padding]
        return indices[self.rank : self.total_size : self.num_replicas]

    def seek(self, position: int) -> None:
        """Start the next iterator at ``position`` (samples of this rank's share already consumed).

        Raises:
            ValueError: ``position`` is negative or past the end of the epoch.
        """
        if not isinstance(position, int) or not 0 <= position <= self.num_samples:
            raise ValueError(f"`position` must be an int in [0, {self.num_samples}], got {position!r}")
        self._start = position

    def __iter__(self) -> Iterator[int | SampleKey]:
        start, self._start = self._start, 0  # a seek applies to one iterator only
        epoch = int(self.epoch)
        for index in self.order(epoch)[start:]:
            yield SampleKey(epoch, index) if self.emit_keys else index

    def state_dict(self) -> dict[str, int]:
        """``epoch`` and pending ``start``; the order itself is recomputed, never stored."""
        return {"epoch": int(self.epoch), "start": int(self._start), "seed": int(self.seed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.set_epoch(int(state.get("epoch", 0)))
        self.seek(int(state.get("start", 0)))
