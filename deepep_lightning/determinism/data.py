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

torchdata's ``StatefulDataLoader`` is rebuilt the same way when it is the plain case (a map-style
dataset without a ``state_dict`` of its own, the default samplers): its own state holds the sampler
position and the workers' ``base_seed``, not the workers' RNG states, so random augmentation in
``__getitem__`` draws other numbers after a resume. A ``StatefulDataLoader`` over an iterable or
stateful dataset, or with a custom sampler, is left as it is: Lightning checkpoints its own state,
and the resume is as exact as that state is.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler

from deepep_lightning import _lightning_compat
from deepep_lightning.determinism.rng import fork_global_rng, seed_everything_from
from deepep_lightning.determinism.sampler import SampleKey, SeekableSampler
from deepep_lightning.determinism.streams import derive_seed

__all__ = ["SeededDataset", "SeekableDataLoader", "make_seekable", "put_back_loader_states", "take_loader_states"]


class SeededDataset(Dataset):
    """Wrap a map-style dataset: ``dataset[SampleKey(epoch, i)]`` runs with RNGs seeded from (seed, epoch, i).

    Plain integer keys are passed through untouched. In a worker process the global RNGs are the
    worker's own and are simply reseeded. In the main process (``num_workers=0``) the samples are
    loaded inside :class:`~deepep_lightning.determinism.rng.fork_global_rng` so the training stream is
    not shifted: once per batch (the DataLoader's fetcher calls :meth:`__getitems__` with a batch's
    keys), since putting the states back costs more than reseeding them.

    The fork saves and restores four generators' states (numpy's alone takes about 75 us of host time
    a batch). ``restore_global_rng=False`` leaves the global RNGs at the last sample's streams instead:
    for a caller that reseeds them from the batch position before every step
    (``DeterminismCallback(reseed_every_step=True)``; Lightning fetches a batch before the step's
    ``on_train_batch_start``), so the fork would put back states that the reseed overwrites.

    Args:
        dataset: the map-style dataset.
        seed: the run seed the per-sample streams are derived from.
        restore_global_rng: put the global RNG states back after a batch loaded in the main process
            (default ``True``).
    """

    def __init__(self, dataset: Dataset, seed: int, restore_global_rng: bool = True) -> None:
        self.dataset = dataset
        self.seed = int(seed)
        self.restore_global_rng = bool(restore_global_rng)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _load(self, key: Any) -> Any:
        if not isinstance(key, SampleKey):
            return self.dataset[key]
        seed_everything_from(self.seed, "sample", key.epoch, key.index)
        return self.dataset[key.index]

    def __getitem__(self, key: Any) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        """The samples of ``keys``, each with its own seeded streams (one batch of the DataLoader's fetcher)."""
        if (
            not self.restore_global_rng
            or torch.utils.data.get_worker_info() is not None
            or not any(isinstance(key, SampleKey) for key in keys)
        ):
            return [self._load(key) for key in keys]
        with fork_global_rng():
            return [self._load(key) for key in keys]


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


def _stateful_dataloader_types() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """torchdata's (loader, random sampler, batch sampler) classes, or empty tuples when it is not imported.

    Read from ``sys.modules``: a ``StatefulDataLoader`` exists only once its module is imported, so
    torchdata stays an optional dependency that this module never imports.
    """
    loader_module = sys.modules.get("torchdata.stateful_dataloader.stateful_dataloader")
    sampler_module = sys.modules.get("torchdata.stateful_dataloader.sampler")
    if loader_module is None or sampler_module is None:
        return (), (), ()
    return (loader_module.StatefulDataLoader,), (sampler_module.RandomSampler,), (sampler_module.BatchSampler,)


def _is_plain_map_loader(dataloader: DataLoader) -> str | None:
    """Why ``dataloader`` cannot be rebuilt as a SeekableDataLoader, or ``None`` when it can."""
    stateful_loaders, stateful_random_samplers, stateful_batch_samplers = _stateful_dataloader_types()
    if type(dataloader) is not DataLoader and type(dataloader) not in stateful_loaders:
        return f"it is a {type(dataloader).__name__}, not a plain torch DataLoader or torchdata StatefulDataLoader"
    if isinstance(dataloader.dataset, IterableDataset):
        return "its dataset is an IterableDataset (no index to seek to)"
    if type(dataloader) in stateful_loaders and hasattr(dataloader.dataset, "state_dict"):
        return "its dataset has a state_dict of its own, which the StatefulDataLoader checkpoints"
    sampler: Any = dataloader.sampler  # torch's or torchdata's RandomSampler: the same attributes
    random_samplers = (RandomSampler, *stateful_random_samplers)
    if type(sampler) not in (*random_samplers, SequentialSampler):
        return f"its sampler is a {type(sampler).__name__}"
    if type(sampler) in random_samplers and (
        sampler.replacement or _lightning_compat.random_sampler_num_samples(sampler) is not None
    ):
        return "its RandomSampler draws with replacement or a custom num_samples"
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is not None and type(batch_sampler) not in (BatchSampler, *stateful_batch_samplers):
        return f"its batch_sampler is a {type(batch_sampler).__name__}"
    return None


def make_seekable(
    dataloader: Any, *, seed: int, rank: int = 0, world_size: int = 1, restore_global_rng: bool = True
) -> tuple[Any, str | None]:
    """Rebuild a plain map-style DataLoader (or torchdata ``StatefulDataLoader``) as a :class:`SeekableDataLoader`.

    The order becomes ``derive_seed(seed, "order", epoch)`` (shuffled iff the original sampler was
    a ``RandomSampler``), split over ``world_size`` ranks like ``DistributedSampler``; every other
    argument is kept (a ``StatefulDataLoader``'s ``snapshot_every_n_steps`` has nothing left to
    snapshot). Returns ``(loader, None)``, or ``(dataloader, reason)`` unchanged when it cannot be
    rebuilt (custom samplers, iterable or stateful datasets, other DataLoader subclasses).
    ``restore_global_rng`` is :class:`SeededDataset`'s.

    Example::

        loader, reason = make_seekable(DataLoader(dataset, batch_size=8, shuffle=True), seed=7)
        assert reason is None and isinstance(loader, SeekableDataLoader)
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
        shuffle=isinstance(dataloader.sampler, (RandomSampler, *_stateful_dataloader_types()[1])),
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
    dataset = SeededDataset(dataloader.dataset, seed, restore_global_rng=restore_global_rng)
    return SeekableDataLoader(dataset, **kwargs), None


def _fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The fit loop's part of a Lightning checkpoint (``checkpoint["loops"]["fit_loop"]["state_dict"]``)."""
    state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")
    return state if isinstance(state, dict) else None


def take_loader_states(checkpoint: dict[str, Any], loaders: list[Any], is_own: Any) -> dict[str, list] | None:
    """Move the states of the loaders ``is_own`` picks out of the checkpoint's train-loader states.

    Lightning stores one state per stateful train loader, in order, under the fit loop's
    ``combined_loader`` key, and on resume hands them back by position: a checkpoint holding the
    state of a loader the resuming run does not have (a :class:`SeekableDataLoader` this plugin
    built, resumed without the plugin) fails with "The CombinedLoader has 0 stateful loaders".
    ``loaders`` are the fit loop's train loaders, flattened as Lightning flattens them. Returns
    ``{"positions", "states"}`` for :func:`put_back_loader_states`, or ``None`` when nothing moved
    (no own loader, or states that do not line up with ``loaders``).
    """
    loop_state = _fit_loop_state(checkpoint)
    states = None if loop_state is None else loop_state.get("combined_loader")
    stateful = [loader for loader in loaders if hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")]
    if loop_state is None or not states or len(states) != len(stateful):
        return None
    positions = [position for position, loader in enumerate(stateful) if is_own(loader)]
    if not positions:
        return None
    kept = [state for position, state in enumerate(states) if position not in positions]
    if kept:
        loop_state["combined_loader"] = kept
    else:
        del loop_state["combined_loader"]  # as Lightning writes a checkpoint without stateful loaders
    return {"positions": positions, "states": [states[position] for position in positions]}


def put_back_loader_states(checkpoint: dict[str, Any], taken: dict[str, list]) -> None:
    """Undo :func:`take_loader_states` on a loaded checkpoint, before Lightning restores its loops."""
    loop_state = _fit_loop_state(checkpoint)
    if loop_state is None:
        return
    merged = list(loop_state.get("combined_loader", []))
    for position, state in zip(taken["positions"], taken["states"]):  # ascending: each lands where it was
        merged.insert(position, state)
    loop_state["combined_loader"] = merged
