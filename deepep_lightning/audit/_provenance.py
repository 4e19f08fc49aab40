"""Where an op seen by a dispatch mode comes from: the user's frame, the qualified module path, the phase.

Shared by the op-hash log (:mod:`.op_hashes`) and the non-finite locator (:mod:`.nonfinite`), so
both name the same frame and the same module for the same op.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Collection
from typing import Any

import torch

from deepep_lightning._lightning_compat import module_tracker

__all__: list[str] = []

# torch, the standard library, installed packages and this audit package: never the user's code
_LIBRARY_DIRS = tuple(
    os.path.normpath(directory) + os.sep
    for directory in {
        os.path.dirname(os.path.abspath(torch.__file__)),
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
        os.path.dirname(os.path.abspath(__file__)),
    }
)
# Lightning's packages wherever they are installed (a checkout on PYTHONPATH too)
_LIBRARY_PACKAGES = tuple(
    f"{os.sep}{name}{os.sep}" for name in ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities")
)


@functools.lru_cache(maxsize=4096)
def _is_library_file(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string>, <stdin>
        return True
    path = os.path.normpath(os.path.abspath(filename))
    return path.startswith(_LIBRARY_DIRS) or any(package in path for package in _LIBRARY_PACKAGES)


def normalise_files(files: Collection[str]) -> frozenset[str]:
    """Absolute, normalised paths, for :func:`is_user_file`'s ``internal_files``."""
    return frozenset(os.path.normpath(os.path.abspath(f)) for f in files)


def is_user_file(filename: str, internal_files: frozenset[str] = frozenset()) -> bool:
    """Whether a frame of ``filename`` is the user's code: not torch, Lightning, the standard library,
    an installed package, this audit package, nor one of ``internal_files`` (from :func:`normalise_files`:
    the caller's own wrappers around the step, e.g. the rollback's replay)."""
    if _is_library_file(filename):
        return False
    return not internal_files or os.path.normpath(os.path.abspath(filename)) not in internal_files


def named_module_tracker(module: torch.nn.Module) -> Any:
    """A ``ModTracker`` (from :func:`~deepep_lightning._lightning_compat.module_tracker`) that names every
    submodule of ``module`` by its qualified path in ``module.named_modules()`` (``blocks.2.attn``).

    On its own, ``ModTracker`` names a module by its class when its parent's ``forward`` never ran,
    which is the rule in a LightningModule (``training_step`` is not ``forward``): ``Attn`` for each of
    24 identical blocks. The root is named by its class. None without a tracker.
    """
    tracker = module_tracker()
    if tracker is None:
        return None
    # ModTracker's name table (private): filled in advance and marked as walked, so it keeps these names
    known, seen = getattr(tracker, "_known_modules", None), getattr(tracker, "_seen_modules", None)
    if known is not None and seen is not None:
        root = type(module).__name__
        for name, submodule in module.named_modules():
            known[submodule] = name or root
            seen.add(submodule)
        tracker.deepep_root_name = root
    return tracker


def innermost_module(tracker: Any) -> str | None:
    """The deepest module path a ``ModTracker`` is inside now (None without a tracker or outside modules)."""
    if tracker is None:
        return None
    root = getattr(tracker, "deepep_root_name", None)
    names = [name for name in tracker.parents if name != "Global"]
    return max(names, key=lambda name: (-1 if name == root else name.count("."), len(name))) if names else None


def in_backward(tracker: Any, node: Any) -> bool:
    """True while autograd runs a backward: an autograd node is current, or the tracker says so."""
    return node is not None or bool(getattr(tracker, "is_bw", False))
