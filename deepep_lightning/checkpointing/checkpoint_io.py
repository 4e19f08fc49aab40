"""AtomicCheckpointIO: Lightning checkpoints that are complete or absent, and a full disk named clearly.

Every checkpoint Lightning writes through the strategy (``ModelCheckpoint``'s files and its
``save_last=True`` copy, ``trainer.save_checkpoint``, :class:`~deepep_lightning.PreemptionCallback`'s
save) is serialised in memory (as Lightning's own save does), then written by
:func:`~deepep_lightning.checkpointing.atomic_file.atomic_write_bytes`: a temporary file in the
destination directory, fsync, ``os.replace``. A failed write (``ENOSPC``, ``EIO``, a permission)
leaves no file under the final name, so the previous checkpoint stays the newest, and the error
names the path, the bytes needed and the bytes free. Remote paths (``s3://``, ``gs://``, ...) keep
Lightning's fsspec transaction.

``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a symlink without going through the
checkpoint IO; ``save_last=True`` writes it as a full file through this class.
"""

from __future__ import annotations

import io
import logging
import os
import warnings
from typing import Any, Literal

import fsspec
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from deepep_lightning import _checks
from deepep_lightning.checkpointing.atomic_file import atomic_write_bytes, write_failure_message

__all__ = ["AtomicCheckpointIO", "CheckpointWriteError", "OnWriteError"]

log = logging.getLogger(__name__)

OnWriteError = Literal["raise", "warn"]


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; nothing was left under its name (the message says why and the sizes)."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write local checkpoints atomically in their own directory; remote ones through fsspec as Lightning does.

    Args:
        on_write_error: ``"raise"`` (default): a failed write raises :class:`CheckpointWriteError`
            and the fit stops. ``"warn"``: the failure is a warning, training continues and the
            next save tries again; until a save succeeds, ``ModelCheckpoint`` removes no older
            checkpoint (its top-k bookkeeping would otherwise delete the newest file that exists).

    Raises:
        MisconfigurationException: ``on_write_error`` is not ``"raise"`` or ``"warn"``.

    Example::

        trainer = Trainer(plugins=[AtomicCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
    """

    def __init__(self, on_write_error: OnWriteError = "raise") -> None:
        super().__init__()
        self.on_write_error: OnWriteError = _checks.choice(None, "on_write_error", on_write_error, ("raise", "warn"))
        self.failed_writes = 0  # since the last successful write

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path``: atomically in ``path``'s directory when it is a local path.

        Raises:
            TypeError: ``storage_options`` is given (as Lightning's ``TorchCheckpointIO``).
            CheckpointWriteError: the write failed and ``on_write_error="raise"``.
        """
        if fsspec.utils.get_protocol(str(path)) != "file":
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                f"`storage_options` is not supported by {type(self).__name__} for local paths, got {storage_options!r}"
            )
        local = os.fspath(path).removeprefix("file://")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getbuffer()
        try:
            os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
            atomic_write_bytes(local, data)
        except OSError as error:
            self.failed_writes += 1
            message = write_failure_message("checkpoint", local, len(data), error)
            if self.on_write_error == "raise":
                raise CheckpointWriteError(
                    f"{message} The previous checkpoint is the newest. HINT: free space there, save elsewhere"
                    " (`ModelCheckpoint(dirpath=...)`), or pass `AtomicCheckpointIO(on_write_error='warn')` to"
                    " keep training and retry at the next save."
                ) from error
            warnings.warn(f"{message} Training continues; the next save tries again.", stacklevel=2)
            return
        self.failed_writes = 0

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove ``path``, unless the last write failed (then it may be the newest checkpoint there is)."""
        if self.failed_writes:
            log.info("AtomicCheckpointIO: %r kept: the last checkpoint write failed", os.fspath(path))
            return
        super().remove_checkpoint(path)
