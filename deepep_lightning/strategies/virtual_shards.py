"""Virtual ranks: a fixed micro-batch partition, so 1, 2, ..., K processes train on the same global batch.

With ``virtual_world_size=K`` the data is always split as if ``K`` ranks trained: virtual rank
``v`` gets the ``DistributedSampler`` shard ``(seed, epoch, v, K)``. A run with ``W`` processes
(``K % W == 0``) gives each process ``K / W`` virtual ranks and accumulates their micro-batches
(``accumulate_grad_batches = K / W``); :class:`VirtualShardSampler` yields them interleaved batch
by batch, so optimizer step ``s`` of every run sees micro-batch ``s`` of every virtual rank.

Why every ``W`` then agrees bit for bit (same hardware and kernels, ``K`` a power of two): each
micro-batch's gradient is the same bits in all of them (same weights, same inputs, same
per-micro-batch random stream); the ``K`` gradients are added in virtual-rank order,
``((g0 + g1) + g2) + ...``, whatever ``W``: by ``AccumulateGrad`` in one process, by
:class:`~deepep_lightning.strategies.micro_batch_gradients.MicroBatchGradients` when a process of
several accumulates (it keeps the micro-batches apart and adds the gathered rows), by the ordered
hook (:mod:`~deepep_lightning.strategies.ordered_reduction`) when each process has one; and the
scalings (Lightning's ``1 / (K / W)`` of the loss, the ``1 / W`` of the average) are powers of two,
which commute exactly with rounding. With ``K`` not a power of two the scalings round.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, cast

from torch.utils.data import Dataset, DistributedSampler

from deepep_lightning.determinism.streams import derive_seed

__all__ = ["VirtualShardSampler", "sampler_seed"]


def sampler_seed(seed: int) -> int:
    """The ``DistributedSampler`` seed of run seed ``seed`` (room left for ``+ epoch`` in 63 bits)."""
    return derive_seed(seed, "sampler") >> 1


class VirtualShardSampler(DistributedSampler):
    """The shards of virtual ranks ``rank * K/W ... (rank+1) * K/W - 1``, interleaved batch by batch.

    Args:
        dataset: the dataset (only its length is used).
        virtual_world_size: ``K``, the number of virtual ranks the data is split over.
        num_replicas: ``W``, the number of processes (a divisor of ``K``).
        rank: this process.
        batch_size: micro-batch size of the DataLoader (each virtual shard must divide into it).
        seed: run seed.
        shuffle: permute each epoch (as ``DistributedSampler``).

    Raises:
        ValueError: ``K`` is not a multiple of ``W``, or a shard does not divide into batches.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        virtual_world_size: int,
        num_replicas: int,
        rank: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if virtual_world_size % num_replicas:
            raise ValueError(
                f"`virtual_world_size` ({virtual_world_size}) must be a multiple of the world size ({num_replicas})"
            )
        super().__init__(
            cast("Dataset[Any]", dataset),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=sampler_seed(seed),
        )
        self.virtual_world_size = virtual_world_size
        self.per_process = virtual_world_size // num_replicas
        self.batch_size = int(batch_size)
        self.run_seed = seed
        self._virtual: list[DistributedSampler[int]] = [
            DistributedSampler(
                cast("Dataset[Any]", dataset),
                num_replicas=virtual_world_size,
                rank=rank * self.per_process + j,
                shuffle=shuffle,
                seed=sampler_seed(seed),
            )
            for j in range(self.per_process)
        ]
        shard = self._virtual[0].num_samples
        if shard % self.batch_size:
            raise ValueError(
                f"each virtual shard has {shard} samples, not a multiple of batch_size={self.batch_size}:"
                " the last micro-batches would merge. HINT: choose a dataset length divisible by"
                f" virtual_world_size x batch_size = {virtual_world_size * self.batch_size}"
            )
        self.num_samples = shard * self.per_process
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        for sampler in self._virtual:
            sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        shards = [list(sampler) for sampler in self._virtual]
        for start in range(0, len(shards[0]), self.batch_size):
            for shard in shards:  # micro-batch j of this step = virtual rank rank * K/W + j
                yield from shard[start : start + self.batch_size]

    def __len__(self) -> int:
        return self.num_samples
