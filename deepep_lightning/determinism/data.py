"""Seekable data loading: per-sample random streams and a DataLoader that resumes mid-epoch in O(1).

Lightning 2.6 on a mid-epoch resume (``training_epoch_loop.py``, ``fit_loop.py``): it restores the
batch counters, then starts a *fresh* iterator of the train DataLoader, which yields the first
``N - k`` batches of a new epoch order (a new ``RandomSampler`` permutation drawn from the global
RNG) and warns "your dataloader is not resumable". Only when the DataLoader object itself has
``state_dict``/``load_state_dict`` (``_Stateful``) does the fit loop save that state in the
checkpoint and call ``load_state_dict`` before it creates the iterator. Two more details matter:
the iterator of the first epoch after ``fit`` starts is created in ``FitLoop.setup_data`` *before*
``sampler.set_epoch`` is called (with workers, indices of the wrong epoch are prefetched on a
resume at epoch > 0), and every iterator draws its ``base_seed`` from the global torch RNG unless
the loader has its own ``generator``.

:class:`SeekableDataLoader` answers all three: it is ``_Stateful`` (state = epoch and batches
yielded), it creates the underlying iterator lazily (on the first ``next``, after ``set_epoch``),
and it owns a generator. Its :class:`~deepep_lightning.determinism.sampler.SeekableSampler` makes
the order a pure function of (seed, epoch, rank), and :class:`SeededDataset` reseeds torch, numpy
and ``random`` before each ``__getitem__`` from ``(seed, epoch, index)``, so random augmentation
gives the same sample whichever worker loads it and however many workers there are.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler

from deepep_lightning import _lightning_compat
from deepep_lightning.determinism.rng import fork_global_rng, seed_everything_from
from deepep_lightning.determinism.sampler import SampleKey, SeekableSampler
from deepep_lightning.determinism.streams import derive_seed

__all__ = ["SeededDataset", "SeekableDataLoader", "make_seekable"]


class SeededDataset(Dataset):
    """Wrap a map-style dataset: ``dataset[SampleKey(epoch, i)]`` runs with RNGs seeded from (seed, epoch, i).

    Plain integer keys are passed through untouched. In a worker process the global RNGs are the
    worker's own and are simply reseeded; in the main process (``num_workers=0``) the call runs
    inside :class:`~deepep_lightning.determinism.rng.fork_global_rng` so the training stream is not
    shifted.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = int(seed)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        if not isinstance(key, SampleKey):
            return self.dataset[key]
        if torch.utils.data.get_worker_info() is not None:
            seed_everything_from(self.seed, "sample", key.epoch, key.index)
            return self.dataset[key.index]
        with fork_global_rng():
            seed_everything_from(self.seed, "sample", key.epoch, key.index)
            return self.dataset[key.index]


def _seed_worker(worker_id: int, *, seed: int, rank: int) -> None:
    """Worker-level streams for randomness outside ``__getitem__`` (e.g. in ``collate_fn``)."""
    seed_everything_from(seed, "worker", rank, worker_id)


class SeekableDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`SeekableSampler` that Lightning can checkpoint and seek.

    ``state_dict()`` = ``{"epoch", "batches"}`` (batches yielded by the current iterator, which is
    what the fit loop has consumed, since Lightning does not prefetch a sized loader);
    ``load_state_dict()`` makes the next iterator start after those batches, in O(1).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, SeekableSampler):
            raise TypeError(f"SeekableDataLoader needs a SeekableSampler, got {type(self.sampler).__name__}")
        self._batches_yielded = 0
        self._resume_batches = 0

    @property
    def _samples_per_batch(self) -> int:
        return 1 if self.batch_size is None else int(self.batch_size)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # A generator: nothing below runs before the first next(), i.e. after Lightning's set_epoch.
        sampler: SeekableSampler = self.sampler  # type: ignore[assignment]
        resume, self._resume_batches = self._resume_batches, 0
        sampler.seek(min(resume * self._samples_per_batch, sampler.num_samples))
        self._batches_yielded = resume
        for batch in super().__iter__():
            self._batches_yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(self.sampler.epoch), "batches": int(self._batches_yielded)}  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.set_epoch(int(state.get("epoch", 0)))  # type: ignore[attr-defined]
        batches = int(state.get("batches", 0))
        # A checkpoint taken after the epoch's last batch: Lightning counts that epoch as finished on
        # restore and starts the next one (set_epoch follows), so the next iterator starts at batch 0.
        # Seeking to the end instead would yield an empty epoch and shift the epoch counter by one.
        self._resume_batches = 0 if batches >= len(self) else batches


def _is_plain_map_loader(dataloader: DataLoader) -> str | None:
    """Why ``dataloader`` cannot be rebuilt as a SeekableDataLoader, or ``None`` when it can."""
    if type(dataloader) is not DataLoader:
        return f"it is a {type(dataloader).__name__}, not a plain torch DataLoader"
    if isinstance(dataloader.dataset, IterableDataset):
        return "its dataset is an IterableDataset (no index to seek to)"
    sampler = dataloader.sampler
    if type(sampler) not in (RandomSampler, SequentialSampler):
        return f"its sampler is a {type(sampler).__name__}"
    if isinstance(sampler, RandomSampler) and (
        sampler.replacement or _lightning_compat.random_sampler_num_samples(sampler) is not None
    ):
        return "its RandomSampler draws with replacement or a custom num_samples"
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) is not torch.utils.data.BatchSampler:
        return f"its batch_sampler is a {type(batch_sampler).__name__}"
    return None


def make_seekable(dataloader: Any, *, seed: int, rank: int = 0, world_size: int = 1) -> tuple[Any, str | None]:
    """Rebuild a plain map-style DataLoader as a :class:`SeekableDataLoader`.

    The order becomes ``derive_seed(seed, "order", epoch)`` (shuffled iff the original sampler was
    a ``RandomSampler``), split over ``world_size`` ranks like ``DistributedSampler``; every other
    argument is kept. Returns ``(loader, None)``, or ``(dataloader, reason)`` unchanged when it
    cannot be rebuilt (custom samplers, iterable datasets, DataLoader subclasses).
    """
    if isinstance(dataloader, SeekableDataLoader):
        return dataloader, None
    if not isinstance(dataloader, DataLoader):
        return dataloader, f"it is a {type(dataloader).__name__}, not a DataLoader"
    reason = _is_plain_map_loader(dataloader)
    if reason is not None:
        return dataloader, reason
    drop_last = bool(dataloader.drop_last) if dataloader.batch_size is not None else False
    sampler = SeekableSampler(
        dataloader.dataset,  # type: ignore[arg-type]
        seed=seed,
        shuffle=isinstance(dataloader.sampler, RandomSampler),
        num_replicas=world_size,
        rank=rank,
        emit_keys=True,
    )
    worker_init_fn = dataloader.worker_init_fn or functools.partial(_seed_worker, seed=seed, rank=rank)
    kwargs: dict[str, Any] = {
        "batch_size": dataloader.batch_size,
        "sampler": sampler,
        "num_workers": dataloader.num_workers,
        "collate_fn": dataloader.collate_fn,
        "pin_memory": dataloader.pin_memory,
        "drop_last": drop_last,
        "timeout": dataloader.timeout,
        "worker_init_fn": worker_init_fn,
        "multiprocessing_context": dataloader.multiprocessing_context,
        # its own generator: creating an iterator must not consume the global torch RNG
        "generator": torch.Generator().manual_seed(derive_seed(seed, "loader", rank)),
        "persistent_workers": dataloader.persistent_workers,
        "pin_memory_device": dataloader.pin_memory_device,
    }
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    if hasattr(dataloader, "in_order"):
        kwargs["in_order"] = dataloader.in_order
    return SeekableDataLoader(SeededDataset(dataloader.dataset, seed), **kwargs), None
