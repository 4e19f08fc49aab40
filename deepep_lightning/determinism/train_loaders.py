"""DeterminismCallback's rebuild of the train loaders as seekable ones, one loader at a time.

Lightning hands the train dataloader source's result over as a single ``DataLoader``, a
``CombinedLoader`` or any collection of loaders; :func:`make_train_loaders_seekable` rebuilds each
plain map-style one with :func:`~deepep_lightning.determinism.data.make_seekable` and keeps the
structure. A loader that stays as it is gets a reason: a ``StatefulDataLoader`` whose own state
Lightning checkpoints is said once (``rank_zero_info``); any other loader cannot resume mid-epoch
exactly, which ``strict`` refuses and otherwise warns about.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from deepep_lightning.determinism.data import make_seekable

__all__ = ["make_train_loaders_seekable"]


def make_train_loaders_seekable(
    loaders: Any,
    *,
    seed: int,
    rank: int,
    world_size: int,
    strict: bool,
    made: weakref.WeakSet[Any],
    restore_global_rng: bool = True,
) -> Any:
    """``loaders`` with every plain map-style loader rebuilt as a seekable one, added to ``made``.

    Returns a single loader for a single ``DataLoader``, the same ``CombinedLoader`` (its loaders
    replaced) for a ``CombinedLoader``, and a ``"max_size_cycle"`` ``CombinedLoader`` for any other
    collection. ``restore_global_rng`` is :class:`~deepep_lightning.determinism.data.SeededDataset`'s.

    Raises:
        MisconfigurationException: under ``strict``, a loader can be neither rebuilt nor checkpointed.
    """

    def convert(loader: Any) -> Any:
        new, reason = make_seekable(
            loader, seed=seed, rank=rank, world_size=world_size, restore_global_rng=restore_global_rng
        )
        if new is not loader:
            made.add(new)
        if reason is not None and hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"):
            rank_zero_info(
                f"DeterminismCallback: the train loader ({type(loader).__name__}) is not rebuilt as a seekable"
                f" one because {reason}; Lightning checkpoints its own state_dict, and a mid-epoch resume is"
                " as exact as that state (a worker's RNG state is not part of a StatefulDataLoader's)."
            )
        elif reason is not None:
            message = (
                f"DeterminismCallback: the train loader cannot be made seekable because {reason};"
                " a mid-epoch resume will not be exact. HINT: use a plain DataLoader over a map-style"
                " dataset, or a `SeekableSampler`, or pass seekable_data=False to silence this."
            )
            if strict:
                raise MisconfigurationException(message)
            rank_zero_warn(message)
        return new

    if isinstance(loaders, CombinedLoader):
        loaders.flattened = [convert(loader) for loader in loaders.flattened]
        return loaders
    if isinstance(loaders, torch.utils.data.DataLoader):
        return convert(loaders)
    combined = CombinedLoader(loaders, "max_size_cycle")
    combined.flattened = [convert(loader) for loader in combined.flattened]
    return combined
