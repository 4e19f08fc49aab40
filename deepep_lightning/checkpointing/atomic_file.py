"""Atomic local file writes: the final name holds the old file or the complete new one, never a part.

The bytes go to ``<path>.tmp.<pid>`` in the *destination directory* (same file system, so the
commit is a rename, not a copy), are fsynced, and ``os.replace`` puts them under the final name;
the directory is fsynced after, so the rename survives a power loss too. A write that fails
(``ENOSPC``, ``EIO``, a permission) removes its temporary file and raises; a process killed in
the middle leaves only the temporary file, which
:func:`~deepep_lightning.health.snapshot_file.remove_dead_temporary_files` removes later.

:func:`write_failure_message` turns the error into a message naming the path, the bytes the file
needs and the bytes free where it goes.

Lightning's own "atomic" save (``lightning.fabric.utilities.cloud_io._atomic_save``) writes
through an fsspec transaction whose temporary file lives in the system temporary directory; on
another file system the commit is a copy, and a copy that fails leaves a truncated file under the
final name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

__all__ = ["atomic_write_bytes", "temporary_path", "write_failure_message"]

_CHUNK_BYTES = 16 * 1024 * 1024  # bounded write calls: a failure is seen after at most one chunk


def temporary_path(path: str) -> str:
    """Where :func:`atomic_write_bytes` writes ``path``'s bytes before the rename (the same directory)."""
    return f"{path}.tmp.{os.getpid()}"


def _write_all(handle: object, data: memoryview) -> None:
    write = handle.write  # type: ignore[attr-defined]
    for start in range(0, len(data), _CHUNK_BYTES):
        write(data[start : start + _CHUNK_BYTES])


def _fsync_directory(directory: str) -> None:
    # makes the rename durable; some file systems (and all of Windows) refuse to open a directory
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def atomic_write_bytes(path: str, data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` to the local file ``path`` atomically (temporary file beside it, fsync, rename).

    Raises:
        OSError: the write, the fsync or the rename failed; the temporary file is removed and
            ``path`` is left as it was.
    """
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as handle:
            _write_all(handle, memoryview(data))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_directory(os.path.dirname(os.path.abspath(path)))


def _format_bytes(count: int) -> str:
    return f"{count} bytes ({count / 2**20:.1f} MiB)"


def write_failure_message(what: str, path: str, needed_bytes: int, error: OSError) -> str:
    """One line naming what failed to be written, where, the bytes it needs and the bytes free there."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        free = _format_bytes(shutil.disk_usage(directory).free)
    except OSError:
        free = "an unknown number of bytes"
    code = errno.errorcode.get(error.errno, str(error.errno)) if error.errno is not None else "no errno"
    reason = error.strerror or str(error)
    return (
        f"could not write the {what} {path!r}: {reason} ({code}). It needs {_format_bytes(needed_bytes)};"
        f" the file system of {directory!r} has {free} free. No partial file is left under that name."
    )
