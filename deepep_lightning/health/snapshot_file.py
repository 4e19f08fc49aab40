"""The snapshot file format: atomic, checksummed files that are either complete or absent.

A file is ``MAGIC | payload length | sha256 | torch.save payload``, written to a temporary file
beside it, fsynced and renamed (:func:`~deepep_lightning.checkpointing.atomic_file.atomic_write_bytes`),
so a crash or a full disk mid-write leaves no partial file under the final name (a failed write raises
:class:`SnapshotWriteError` naming the path, the bytes needed and the bytes free); a truncated
or corrupted file fails verification with :class:`CorruptSnapshotError`. The payload is tensors
and plain values, read with ``torch.load(weights_only=True)``. A write whose process died leaves
its ``*.tmp.<pid>`` file behind: :func:`remove_dead_temporary_files` removes those.
:mod:`deepep_lightning.health.snapshot` turns a payload into a
:class:`~deepep_lightning.health.snapshot.Snapshot` and back.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import struct
from typing import Any

import torch

from deepep_lightning.checkpointing.atomic_file import atomic_write_bytes, write_failure_message

__all__ = [
    "CorruptSnapshotError",
    "SnapshotWriteError",
    "prepare_writable_directory",
    "read_snapshot_payload",
    "remove_dead_temporary_files",
    "write_snapshot_payload",
]

_MAGIC = b"DEEPEPSNAP1\n"
_HEADER = struct.Struct("<Q32s")


class CorruptSnapshotError(RuntimeError):
    """An on-disk snapshot is truncated, corrupted or not a snapshot."""


class SnapshotWriteError(OSError):
    """A snapshot file could not be written (full disk, I/O error, permission); nothing is left under its name."""


def write_snapshot_payload(payload: dict[str, Any], path: str) -> int:
    """Write ``payload`` to ``path`` atomically (temporary file, fsync, rename) with a sha256 checksum.

    Returns the file's size in bytes.

    Raises:
        SnapshotWriteError: the write failed; the message names the path, the bytes needed and the bytes free.
    """
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    blob = _MAGIC + _HEADER.pack(len(data), hashlib.sha256(data).digest()) + data
    try:
        atomic_write_bytes(path, blob)
    except OSError as error:
        raise SnapshotWriteError(error.errno, write_failure_message("snapshot", path, len(blob), error)) from error
    return len(blob)


def read_snapshot_payload(path: str) -> dict[str, Any]:
    """Read and verify the payload of a snapshot file.

    Raises:
        CorruptSnapshotError: missing magic, truncated payload or checksum mismatch.
    """
    with open(path, "rb") as handle:
        raw = handle.read()
    head = len(_MAGIC) + _HEADER.size
    if not raw.startswith(_MAGIC) or len(raw) < head:
        raise CorruptSnapshotError(f"{path!r} is not a deepep_lightning snapshot (bad header)")
    length, digest = _HEADER.unpack(raw[len(_MAGIC) : head])
    data = raw[head:]
    if len(data) != length:
        raise CorruptSnapshotError(f"{path!r} is truncated: {len(data)} of {length} payload bytes")
    if hashlib.sha256(data).digest() != digest:
        raise CorruptSnapshotError(f"{path!r} is corrupted: sha256 checksum mismatch")
    try:
        payload: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # a state_dict holding a Python object (e.g. a custom LR scheduler's); the file passed its checksum
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    return payload


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_temporary_files(directory: str) -> list[str]:
    """Delete ``*.tmp.<pid>`` files of snapshot writes whose process is gone; returns their paths."""
    removed: list[str] = []
    if not os.path.isdir(directory):
        return removed
    for name in sorted(os.listdir(directory)):
        stem, _, pid = name.rpartition(".tmp.")
        if not stem or not pid.isdigit() or int(pid) == os.getpid() or _process_alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        try:
            os.remove(path)
        except OSError:
            continue
        removed.append(path)
    return removed


def prepare_writable_directory(directory: str) -> None:
    """Create ``directory`` and check that this process can write a file in it.

    Raises:
        OSError: it cannot be created or written in.
    """
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".write-probe.{os.getpid()}")
    with open(probe, "wb"):
        pass
    os.remove(probe)
