"""Healthy-state snapshots: capture to host memory (async pinned copies), restore exactly, atomic disk files.

A snapshot holds everything a replay needs to recompute the same steps bit for
bit: model and optimizer tensors, LR schedulers, the AMP scaler, every RNG
(:func:`~deepep_lightning.determinism.rng.capture_rng_state`), the loop's optimizer-step
counters, the module's rollout state (when it implements
:class:`~deepep_lightning.protocols.RolloutStateful`: state that lives outside parameters),
the health callback's state (spike window), the LR scale applied by rollback and the accumulated
states of the module's torchmetrics metrics, so replayed steps are not counted twice
(:mod:`deepep_lightning._metric_state`).

Restoring is **in place**: parameters, buffers, optimizer state and the rollout
state are copied into the live tensors, never replaced, because a captured CUDA
graph (e.g. a module whose step is one graph) keeps raw pointers to them and would
otherwise go on reading freed memory (:mod:`deepep_lightning.health.state_copies`).

On disk a snapshot is an atomic, checksummed file (:mod:`deepep_lightning.health.snapshot_file`):
a truncated or corrupted file fails verification with :class:`CorruptSnapshotError`, is deleted,
and the ring falls back to the previous one. A snapshot that cannot be written (a full disk) is a
warning naming the path and the sizes, and the ring keeps the snapshots it has. On disk the ring is
bounded in bytes as well as in count (``max_bytes``). Each file carries the id of the run that wrote it (in
its name and its payload): a ring refuses a file of another run (two runs sharing one
``snapshot_dir``), and removes the temporary files of writes whose process died.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from deepep_lightning._lightning_compat import optimizer_step_progress
from deepep_lightning._metric_state import capture_metric_states, restore_metric_states
from deepep_lightning.determinism.rng import capture_rng_state, restore_rng_state
from deepep_lightning.health.snapshot_file import (
    CorruptSnapshotError,
    SnapshotWriteError,
    read_snapshot_payload,
    remove_dead_temporary_files,
    write_snapshot_payload,
)
from deepep_lightning.health.state_copies import (
    copy_into,
    reset_optimizer_state,
    restore_module,
    restore_optimizer,
    to_device,
    to_host,
)
from deepep_lightning.protocols import RolloutStateful

__all__ = [
    "CorruptSnapshotError",
    "Snapshot",
    "SnapshotRing",
    "clone_update_state",
    "load_snapshot_file",
    "remove_dead_temporary_files",
    "restore_update_state",
    "save_snapshot_file",
]


def clone_update_state(pl_module: pl.LightningModule, optimizers: list[torch.optim.Optimizer]) -> list[Any]:
    """Device copies of what an optimizer step changes: the parameters and the optimizer state.

    With :func:`restore_update_state`, this drops one step's update after the fact, for modules
    whose optimizer step runs inside ``training_step`` (manual optimisation, a CUDA graph).
    """
    params = [p.detach().clone() for p in pl_module.parameters()]
    states = [
        {
            id(p): {k: v.detach().clone() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in s.items()}
            for p, s in optimizer.state.items()
        }
        for optimizer in optimizers
    ]
    return [params, states]


def restore_update_state(
    pl_module: pl.LightningModule, optimizers: list[torch.optim.Optimizer], saved: list[Any]
) -> None:
    """Copy :func:`clone_update_state`'s copies back, in place; state created since is reset as in a fresh optimizer."""
    params, states = saved
    with torch.no_grad():
        for live, value in zip(pl_module.parameters(), params):
            live.copy_(value)
    for optimizer, state in zip(optimizers, states):
        for param in list(optimizer.state):
            old = state.get(id(param))
            if old is None:
                reset_optimizer_state(optimizer, param)
                continue
            live = optimizer.state[param]
            for key, value in old.items():
                if not copy_into(live.get(key), value):
                    live[key] = value


@dataclass
class Snapshot:
    """A healthy training state taken after optimizer step ``step - 1`` (``step`` steps done)."""

    step: int
    epoch: int
    model: Any
    optimizers: list[Any]
    schedulers: list[Any]
    scaler: dict[str, Any] | None
    rng: dict[str, Any]
    progress: dict[str, Any]
    rollout: Any
    callback_state: dict[str, Any]
    lr_scale: float
    metrics: dict[str, Any] = field(default_factory=dict)  # accumulated metric states (absent in older files)
    run_id: str = ""  # the run that wrote the file ("" in memory)
    _events: list[torch.cuda.Event] = field(default_factory=list, repr=False)

    @classmethod
    def capture(
        cls, trainer: pl.Trainer, pl_module: pl.LightningModule, callback_state: dict[str, Any], lr_scale: float
    ) -> Snapshot:
        devices: list[torch.device] = []
        automatic, manual = optimizer_step_progress(trainer)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        rollout = pl_module.rollout_state_dict() if isinstance(pl_module, RolloutStateful) else None
        snapshot = cls(
            step=trainer.global_step,
            epoch=trainer.current_epoch,
            model=to_host(pl_module.state_dict(), devices),
            optimizers=[to_host(opt.state_dict(), devices) for opt in trainer.optimizers],
            schedulers=[copy.deepcopy(cfg.scheduler.state_dict()) for cfg in trainer.lr_scheduler_configs],
            scaler=copy.deepcopy(scaler.state_dict()) if scaler is not None else None,
            rng=capture_rng_state(),
            progress={"automatic": copy.deepcopy(automatic.state_dict()), "manual": copy.deepcopy(manual.state_dict())},
            rollout=to_host(rollout, devices) if rollout is not None else None,
            callback_state=copy.deepcopy(callback_state),
            lr_scale=float(lr_scale),
            metrics=to_host(capture_metric_states(pl_module), devices),
        )
        for device in sorted({str(d) for d in devices}):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(torch.device(device)))
            snapshot._events.append(event)
        return snapshot

    def wait(self) -> None:
        """Block until the asynchronous device→host copies have landed."""
        for event in self._events:
            event.synchronize()
        self._events.clear()

    def restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule, restore_progress: bool = True) -> None:
        """Put the trainer and module back to this state (counters too when ``restore_progress``)."""
        self.wait()
        restore_module(pl_module, self.model)
        for optimizer, saved in zip(trainer.optimizers, self.optimizers):
            restore_optimizer(optimizer, saved)
            optimizer.zero_grad(set_to_none=True)
        for cfg, saved in zip(trainer.lr_scheduler_configs, self.schedulers):
            cfg.scheduler.load_state_dict(copy.deepcopy(saved))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(copy.deepcopy(self.scaler))
        restore_rng_state(self.rng)
        if self.rollout is not None and isinstance(pl_module, RolloutStateful):
            pl_module.load_rollout_state_dict(to_device(self.rollout))
        if self.epoch == trainer.current_epoch:  # replayed steps must not be counted twice in epoch metrics
            restore_metric_states(pl_module, to_device(self.metrics), reset_missing=True)
        if restore_progress:
            automatic, manual = optimizer_step_progress(trainer)
            automatic.load_state_dict(copy.deepcopy(self.progress["automatic"]))
            manual.load_state_dict(copy.deepcopy(self.progress["manual"]))

    def restore_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Put back the parameters, buffers and optimizer states only, in place; the RNG, the rollout
        (data position), the LR schedulers and the loop counters stay where they are."""
        self.wait()
        restore_module(pl_module, self.model)
        for optimizer, saved in zip(trainer.optimizers, self.optimizers):
            restore_optimizer(optimizer, saved)
            optimizer.zero_grad(set_to_none=True)

    def payload(self) -> dict[str, Any]:
        self.wait()
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if not k.startswith("_")}


def save_snapshot_file(snapshot: Snapshot, path: str) -> int:
    """Write ``snapshot`` to ``path`` atomically (temporary file, fsync, rename) with a sha256 checksum.

    Returns the file's size in bytes.

    Raises:
        SnapshotWriteError: the write failed (nothing is left under ``path``).
    """
    return write_snapshot_payload(snapshot.payload(), path)


def load_snapshot_file(path: str, run_id: str | None = None) -> Snapshot:
    """Read and verify a snapshot file (written by run ``run_id`` when given).

    Raises:
        CorruptSnapshotError: missing magic, truncated payload, checksum mismatch, or another run's file.
    """
    payload = read_snapshot_payload(path)
    snapshot = Snapshot(**payload)
    if run_id is not None and snapshot.run_id != run_id:
        raise CorruptSnapshotError(
            f"{path!r} was written by run {snapshot.run_id!r}, not by this run ({run_id!r}): another run shares "
            "the snapshot directory. HINT: give each run its own `snapshot_dir`."
        )
    return snapshot


class SnapshotRing:
    """The last ``keep`` healthy snapshots, in host memory or as files in ``directory``.

    Args:
        keep: how many snapshots to keep (>= 1).
        directory: when given, snapshots are files there (host memory holds none); temporary files
            of killed writes found there are removed.
        run_id: the id written into this ring's files and required from them when read.
        max_bytes: on disk, the most bytes the ring's files may take, the file being written
            included (its size estimated by the previous one's): older snapshots are removed first;
            the newest is always kept. ``None``: no byte bound.
    """

    def __init__(
        self, keep: int = 2, directory: str | None = None, run_id: str = "", max_bytes: int | None = None
    ) -> None:
        self.keep = keep
        self.directory = directory
        self.run_id = run_id
        self.max_bytes = max_bytes
        self._items: list[Snapshot | tuple[int, str]] = []  # in memory, or (step, path) on disk
        self._file_bytes: dict[str, int] = {}  # size of each file the ring holds
        self.pinned: int | None = None  # a step kept beyond ``keep`` (the best snapshot by a monitored metric)
        if directory is not None:
            remove_dead_temporary_files(directory)

    def __len__(self) -> int:
        return len(self._items)

    def push(self, snapshot: Snapshot) -> bool:
        """Keep ``snapshot``; returns whether it was kept (``False``: its file could not be written, warned)."""
        if self.directory is None:
            self._items.append(snapshot)
        else:
            os.makedirs(self.directory, exist_ok=True)
            prefix = f"snapshot-{self.run_id}-" if self.run_id else "snapshot-"
            path = os.path.join(self.directory, f"{prefix}step{snapshot.step:09d}.pt")
            snapshot.run_id = self.run_id
            if self.max_bytes is not None and self._file_bytes:  # room for the new file, estimated by the last
                estimate = self._file_bytes[self._items[-1][1]] if isinstance(self._items[-1], tuple) else 0
                while len(self._items) > 1 and sum(self._file_bytes.values()) + estimate > self.max_bytes:
                    if not self._discard_oldest(keep_newest=True):
                        break
            try:
                self._file_bytes[path] = save_snapshot_file(snapshot, path)
            except SnapshotWriteError as error:
                kept = f"the snapshot of step {self.steps()[-1]}" if self._items else "no snapshot"
                warnings.warn(
                    f"{error.strerror} The ring keeps {kept} as its newest; the next snapshot tries again.",
                    stacklevel=2,
                )
                return False
            self._items.append((snapshot.step, path))
        while len(self._items) > self.keep + (self.pinned is not None and self.pinned in self.steps()):
            if not self._discard_oldest(keep_newest=False):
                break
        while self.max_bytes is not None and len(self._items) > 1 and sum(self._file_bytes.values()) > self.max_bytes:
            if not self._discard_oldest(keep_newest=True):
                break
        return True

    def _discard_oldest(self, keep_newest: bool) -> bool:
        """Drop the oldest unpinned snapshot (never the newest when ``keep_newest``); returns whether one was."""
        candidates = self.steps()[:-1] if keep_newest else self.steps()
        index = next((i for i, step in enumerate(candidates) if step != self.pinned), None)
        if index is None:
            return False
        self._discard(self._items.pop(index))
        return True

    def _discard(self, item: Snapshot | tuple[int, str]) -> None:
        if isinstance(item, tuple):
            self._file_bytes.pop(item[1], None)
            with contextlib.suppress(OSError):
                os.remove(item[1])

    def clear(self) -> None:
        """Drop every snapshot (and delete the files)."""
        for item in self._items:
            self._discard(item)
        self._items = []
        self.pinned = None

    def steps(self) -> list[int]:
        """The steps of the snapshots held, oldest first."""
        return [item.step if isinstance(item, Snapshot) else item[0] for item in self._items]

    def files(self) -> list[str]:
        """The paths of the snapshot files held, oldest first (empty for a ring in host memory)."""
        return [item[1] for item in self._items if isinstance(item, tuple)]

    def load(self, step: int, on_corrupt: Callable[[str, Exception], None] | None = None) -> Snapshot | None:
        """The snapshot of ``step``, or None when there is none or its file is corrupt (then deleted and dropped)."""
        for index, item in enumerate(self._items):
            if isinstance(item, Snapshot) and item.step == step:
                return item
            if isinstance(item, tuple) and item[0] == step:
                try:
                    return load_snapshot_file(item[1], self.run_id)
                except (CorruptSnapshotError, OSError, EOFError, RuntimeError) as error:
                    if on_corrupt is not None:
                        on_corrupt(item[1], error)
                    self._discard(self._items.pop(index))
                    return None
        return None

    def latest(
        self, on_corrupt: Callable[[str, Exception], None] | None = None, before_step: int | None = None
    ) -> Snapshot | None:
        """The newest snapshot that loads (and has ``step < before_step`` when given).

        Corrupt files (and files of another run) are reported through ``on_corrupt``, deleted and
        dropped, and the previous one is used.
        """
        index = len(self._items) - 1
        while index >= 0:
            item = self._items[index]
            step = item.step if isinstance(item, Snapshot) else item[0]
            if before_step is not None and step >= before_step:
                index -= 1
                continue
            if isinstance(item, Snapshot):
                return item
            try:
                return load_snapshot_file(item[1], self.run_id)
            except (CorruptSnapshotError, OSError, EOFError, RuntimeError) as error:
                if on_corrupt is not None:
                    on_corrupt(item[1], error)
                self._discard(self._items.pop(index))
                index -= 1
        return None
