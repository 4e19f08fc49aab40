"""Checkpoint integrity for DeterminismCallback: digests of what it resumes from, and readable load errors.

A bit flip in a Lightning checkpoint loads without complaint (``torch.load`` checks the zip
structure, not the tensor bytes) and the run continues from corrupted weights. The callback stores
a SHA-256 digest of its own state and of the model's ``state_dict`` in the checkpoint and compares
them on resume. A file that is empty, truncated or not a checkpoint at all gets an error that names
the file and says what it looks like, instead of torch's zip-reader message.

The digest walks the value in a fixed order (dict keys sorted, tensors as dtype, shape and raw
bytes), so it depends only on the content, never on pickling details or ``PYTHONHASHSEED``.

A sharded ``state_dict`` (FSDP2's ``fully_shard``, tensor parallel: ``DTensor`` values) is digested
per rank: each rank's local shard, with its placements and the global shape, since a rank holds
only its shards and a ``DTensor`` has no bytes of its own. :func:`local_shards_digest` gives that
digest; :func:`is_sharded_state` tells the two kinds apart.
"""

from __future__ import annotations

import functools
import hashlib
import os
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from deepep_lightning.determinism.sharded_resume import gather_per_rank

__all__ = [
    "CheckpointIntegrityError",
    "digest",
    "is_sharded_state",
    "gather_shard_digests",
    "local_shards_digest",
    "model_digest",
    "readable_checkpoint_loader",
]


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint's content does not match the digest written with it, or the file cannot be read."""


def _feed(hasher: Any, value: Any) -> None:
    if isinstance(value, DTensor):  # this rank's shard, and where it sits in the global tensor
        hasher.update(f"S{value.placements}{tuple(value.shape)}".encode())
        _feed(hasher, value.to_local())
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        hasher.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, Mapping):
        hasher.update(f"D{len(value)}".encode())
        for key in sorted(value, key=repr):
            hasher.update(repr(key).encode())
            _feed(hasher, value[key])
    elif isinstance(value, (list, tuple)):
        hasher.update(f"L{len(value)}".encode())
        for item in value:
            _feed(hasher, item)
    elif value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        hasher.update(f"{type(value).__name__}:{value!r}".encode())  # repr is exact for these
    else:  # an object's repr may hold its address: only its type is covered
        hasher.update(f"O{type(value).__module__}.{type(value).__qualname__}".encode())


def digest(value: Any) -> str:
    """SHA-256 hex digest of nested dicts/lists/tuples of tensors and plain values.

    Example::

        digest({"w": torch.ones(2)}) == digest({"w": torch.ones(2)})  # True; a flipped bit changes it
    """
    hasher = hashlib.sha256()
    _feed(hasher, value)
    return hasher.hexdigest()


def is_sharded_state(state_dict: Any) -> bool:
    """Whether a ``state_dict`` holds ``DTensor`` values (each rank has its own shards)."""
    return isinstance(state_dict, Mapping) and any(isinstance(v, DTensor) for v in state_dict.values())


def model_digest(state_dict: Any) -> str | None:
    """Digest of a checkpoint's ``state_dict`` entry, or ``None`` when it is not a dict of plain tensors.

    A sharded ``state_dict`` gives ``None`` here: its digest differs per rank (:func:`local_shards_digest`).
    """
    if not isinstance(state_dict, Mapping) or is_sharded_state(state_dict):
        return None
    if not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        return None
    return digest(state_dict)


def local_shards_digest(state_dict: Any) -> str | None:
    """This rank's digest of a sharded ``state_dict``: local shards, placements, global shapes; else ``None``.

    Example::

        local_shards_digest(fsdp2_module.state_dict())  # differs per rank; equal across two equal runs
    """
    if not is_sharded_state(state_dict):
        return None
    return digest(state_dict)


def gather_shard_digests(state_dict: Any) -> list[str] | None:
    """Every rank's :func:`local_shards_digest`, in rank order; ``None`` for a ``state_dict`` that is not sharded.

    Collective for a sharded ``state_dict`` (every rank calls it: ``Trainer.save_checkpoint`` runs on all
    ranks under a sharding strategy); one process returns its own digest alone.
    """
    local = local_shards_digest(state_dict)
    if local is None:
        return None
    return [str(item) for item in gather_per_rank(local)]


def _describe_unreadable(path: Any, error: BaseException) -> str:
    try:
        size = os.path.getsize(path)
    except (OSError, TypeError):
        size = None
    if size == 0:
        what = "is empty (0 bytes): a write that never finished"
    elif size is not None:
        with open(path, "rb") as file:
            head = file.read(4)
        if head != b"PK\x03\x04":
            what = f"({size} bytes) is not a torch checkpoint (no zip header)"
        elif not zipfile.is_zipfile(path):
            what = f"({size} bytes) is truncated (a torch zip archive without its end record)"
        else:
            what = f"({size} bytes) is a complete torch archive that cannot be loaded"
    else:
        what = "cannot be read"
    # torch's own text about a damaged file talks of zip records or weights_only; it helps only for a whole archive
    detail = f": {error}" if str(error) and ("complete" in what or size is None) else ""
    return (
        f"DeterminismCallback: the checkpoint {str(path)!r} {what} ({type(error).__name__}{detail})."
        " HINT: resume from an earlier checkpoint (ModelCheckpoint writes last.ckpt atomically), or start"
        " without ckpt_path."
    )


def readable_checkpoint_loader(load: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``Strategy.load_checkpoint`` so an unreadable file raises :class:`CheckpointIntegrityError` naming it.

    A missing file keeps Lightning's own ``FileNotFoundError`` (it already names the path).
    """

    @functools.wraps(load)
    def wrapped(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return load(checkpoint_path, *args, **kwargs)
        except FileNotFoundError:
            raise
        except Exception as error:
            raise CheckpointIntegrityError(_describe_unreadable(checkpoint_path, error)) from error

    wrapped.__deepep_readable__ = True  # type: ignore[attr-defined]
    return wrapped
