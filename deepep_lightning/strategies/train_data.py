"""How DeterministicDDPStrategy splits the train data: seeded shards, virtual-rank shards, sampler checks.

Lightning injects a ``DistributedSampler`` built from the strategy's ``distributed_sampler_kwargs``,
whose seed :func:`~deepep_lightning.strategies.virtual_shards.sampler_seed` derives from the run
seed, so a shard is a pure function of (seed, epoch, rank, world size) (:func:`distributed_shard`).
:func:`shard_train_loader` prepares each loader. In world-size-invariant mode it replaces
Lightning's sampler by a :class:`~deepep_lightning.strategies.virtual_shards.VirtualShardSampler`
(:func:`virtual_shard_loader`);
any other sampler would be split over the processes instead of the virtual ranks, which
:func:`check_virtual_sampler` refuses, as :func:`check_distributed_sampler` refuses a
``DistributedSampler`` built for another rank or world size, and :func:`check_partition` a
partition that does not fit the world size and the accumulation.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning import _lightning_compat
from deepep_lightning.strategies.virtual_shards import VirtualShardSampler, sampler_seed

__all__ = [
    "check_distributed_sampler",
    "check_partition",
    "check_virtual_sampler",
    "distributed_shard",
    "is_lightning_sampler",
    "shard_train_loader",
    "virtual_shard_loader",
]


def is_lightning_sampler(sampler: Any) -> bool:
    """Whether ``sampler`` is a plain ``DistributedSampler``, the kind Lightning injects (not a subclass)."""
    return type(sampler) is torch.utils.data.DistributedSampler


def check_partition(virtual_world_size: int, world_size: int, accumulate_grad_batches: int) -> None:
    """World-size-invariant mode: ``virtual_world_size`` fits the world size and the accumulation.

    Raises:
        MisconfigurationException: it does not.
    """
    if virtual_world_size % world_size:
        raise MisconfigurationException(
            f"`DeterministicDDPStrategy(virtual_world_size={virtual_world_size!r})` must be a multiple of the"
            f" world size {world_size}"
        )
    micro_batches_per_step = max(virtual_world_size // world_size, 1)
    if accumulate_grad_batches != micro_batches_per_step:
        raise MisconfigurationException(
            f"`Trainer(accumulate_grad_batches=...)` must be virtual_world_size / world_size ="
            f" {micro_batches_per_step} in world-size-invariant mode, got {accumulate_grad_batches!r}"
            f" (HINT: the global batch is {virtual_world_size} micro-batches whatever the device count)"
        )


def check_distributed_sampler(sampler: Any, world_size: int, rank: int) -> None:
    """A ``DistributedSampler`` in the loader must be built for this rank and world size.

    Raises:
        MisconfigurationException: its ``num_replicas`` or ``rank`` differ.
    """
    if isinstance(sampler, torch.utils.data.DistributedSampler) and world_size > 1:
        if sampler.num_replicas != world_size or sampler.rank != rank:
            raise MisconfigurationException(
                f"DeterministicDDPStrategy: a DistributedSampler with num_replicas={sampler.num_replicas!r},"
                f" rank={sampler.rank!r} runs on rank {rank} of {world_size}."
                " HINT: let Lightning create the sampler (return a plain DataLoader), or build it from"
                " `trainer.strategy.distributed_sampler_kwargs`."
            )


def check_virtual_sampler(sampler: Any, virtual_world_size: int, world_size: int) -> None:
    """World-size-invariant mode splits only Lightning's own ``DistributedSampler`` over the virtual ranks.

    Another sampler (e.g. the ``SeekableSampler`` of ``DeterminismCallback(seekable_data=True)``)
    would be split over the processes instead, so the global batch would change with their number.

    Raises:
        MisconfigurationException: ``sampler`` is neither Lightning's nor a ``VirtualShardSampler``.
    """
    if isinstance(sampler, VirtualShardSampler) or is_lightning_sampler(sampler):
        return
    raise MisconfigurationException(
        f"`DeterministicDDPStrategy(virtual_world_size={virtual_world_size!r})` splits the train data over"
        f" virtual ranks through Lightning's DistributedSampler, but the train loader's sampler is a"
        f" {type(sampler).__name__}, whose shards would follow the {world_size} process(es) instead."
        " HINT: return a plain DataLoader (Lightning adds the sampler); with DeterminismCallback, pass"
        " seekable_data=False."
    )


def shard_train_loader(
    dataloader: Any,
    *,
    training: bool,
    virtual_world_size: int | None,
    micro_batches_per_step: int,
    world_size: int,
    rank: int,
    seed: int,
) -> Any:
    """``dataloader`` as the strategy hands it to Lightning: virtual-rank shards in training when needed.

    In world-size-invariant training with several micro-batches per process, Lightning's
    ``DistributedSampler`` is replaced by a ``VirtualShardSampler`` (:func:`virtual_shard_loader`);
    otherwise the sampler is checked (:func:`check_virtual_sampler`, :func:`check_distributed_sampler`)
    and the loader returned as it is.

    Raises:
        MisconfigurationException: the sampler does not fit the partition, the rank or the world size.
    """
    sampler = getattr(dataloader, "sampler", None)
    if virtual_world_size is not None and training:
        if micro_batches_per_step > 1 and is_lightning_sampler(sampler):
            return virtual_shard_loader(
                dataloader, virtual_world_size=virtual_world_size, world_size=world_size, rank=rank, seed=seed
            )
        if sampler is not None:
            check_virtual_sampler(sampler, virtual_world_size, world_size)
    check_distributed_sampler(sampler, world_size, rank)
    return dataloader


def virtual_shard_loader(dataloader: Any, *, virtual_world_size: int, world_size: int, rank: int, seed: int) -> Any:
    """``dataloader`` with Lightning's ``DistributedSampler`` replaced by a ``VirtualShardSampler``.

    Raises:
        MisconfigurationException: the loader has no ``batch_size``, or the sampler refuses the partition.
    """
    if dataloader.batch_size is None:
        raise MisconfigurationException(
            "DeterministicDDPStrategy(virtual_world_size=...) needs a DataLoader with a batch_size, got batch_size=None"
        )
    try:
        sampler = VirtualShardSampler(
            dataloader.dataset,
            virtual_world_size=virtual_world_size,
            num_replicas=world_size,
            rank=rank,
            batch_size=dataloader.batch_size,
            seed=seed,
            shuffle=dataloader.sampler.shuffle,
        )
    except ValueError as error:
        raise MisconfigurationException(f"DeterministicDDPStrategy: {error}") from error
    return _lightning_compat.update_dataloader(dataloader, sampler)


def distributed_shard(
    num_samples: int,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[int]:
    """The indices ``rank`` sees in ``epoch``: what the injected ``DistributedSampler`` yields.

    ``seed`` is the run seed (the sampler's own seed is derived from it).
    """
    sampler: torch.utils.data.DistributedSampler[int] = torch.utils.data.DistributedSampler(
        cast("torch.utils.data.Dataset[int]", range(num_samples)),
        num_replicas=world_size,
        rank=rank,
        shuffle=shuffle,
        seed=sampler_seed(seed),
        drop_last=drop_last,
    )
    sampler.set_epoch(epoch)
    return list(sampler)
