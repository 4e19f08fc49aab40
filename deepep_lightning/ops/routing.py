"""Route ``F.grid_sample`` / ``F.interpolate`` to the deterministic-backward ops in deterministic mode.

:func:`patch_refused_ops` replaces the two attributes of ``torch.nn.functional`` by thin
wrappers. A wrapped call goes to :func:`deepep_lightning.ops.grid_sample` /
:func:`deepep_lightning.ops.interpolate` only when all of these hold, and to PyTorch's original
function otherwise (so an uncovered case keeps PyTorch's result, and in deterministic mode
PyTorch's own "does not have a deterministic implementation" error):

* ``torch.are_deterministic_algorithms_enabled()`` is ``True`` (``warn_only`` included);
* the case is covered: ``grid_sample`` bilinear 4-D (any padding, both ``align_corners``),
  ``interpolate`` bilinear 4-D without antialias; float16/bfloat16/float32/float64 on CPU or CUDA;
  the extension is built (see ``grid_sample_unsupported_reason`` / ``interpolate_unsupported_reason``).

Every caller that looks the function up at call time is routed: ``F.grid_sample(...)``,
``torch.nn.functional.interpolate(...)``, ``nn.Upsample``, ``nn.UpsamplingBilinear2d``,
``F.upsample*``. A reference taken before patching (``from torch.nn.functional import
grid_sample`` at import time) is not. ``torch.grid_sampler`` and ``torch._C._nn`` ops are not.

Patching is process-global and idempotent; :func:`refused_ops_routing` scopes it.
"""

import contextlib
import functools
import importlib
import logging
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

# The modules, not the same-named functions that deepep_lightning.ops re-exports.
_grid_sample_module = importlib.import_module("deepep_lightning.ops.grid_sample")
_interpolate_module = importlib.import_module("deepep_lightning.ops.interpolate")

__all__ = ["patch_refused_ops", "refused_ops_patched", "refused_ops_routing", "ROUTED_FUNCTIONS"]

log = logging.getLogger(__name__)

#: The ``torch.nn.functional`` attributes that :func:`patch_refused_ops` routes.
ROUTED_FUNCTIONS = ("grid_sample", "interpolate")

_lock = threading.Lock()
_ORIGINALS = {
    "grid_sample": _grid_sample_module._torch_grid_sample,
    "interpolate": _interpolate_module._torch_interpolate,
}


def _routed_grid_sample(input, grid, mode="bilinear", padding_mode="zeros", align_corners=None):
    if torch.are_deterministic_algorithms_enabled():
        # Uncovered arguments are handed to PyTorch's function inside grid_sample itself.
        return _grid_sample_module.grid_sample(input, grid, mode, padding_mode, align_corners)
    return _ORIGINALS["grid_sample"](input, grid, mode=mode, padding_mode=padding_mode, align_corners=align_corners)


def _routed_interpolate(
    input,
    size=None,
    scale_factor=None,
    mode="nearest",
    align_corners=None,
    recompute_scale_factor=None,
    antialias=False,
):
    if torch.are_deterministic_algorithms_enabled():
        return _interpolate_module.interpolate(
            input, size, scale_factor, mode, align_corners, recompute_scale_factor, antialias
        )
    return _ORIGINALS["interpolate"](
        input,
        size=size,
        scale_factor=scale_factor,
        mode=mode,
        align_corners=align_corners,
        recompute_scale_factor=recompute_scale_factor,
        antialias=antialias,
    )


def _wrap(name: str, routed):
    wrapper = functools.wraps(_ORIGINALS[name])(routed)
    wrapper._deepep_original = _ORIGINALS[name]  # read by grid_sample.py / interpolate.py
    return wrapper


_WRAPPERS = {
    "grid_sample": _wrap("grid_sample", _routed_grid_sample),
    "interpolate": _wrap("interpolate", _routed_interpolate),
}


def refused_ops_patched() -> bool:
    """Whether ``F.grid_sample`` and ``F.interpolate`` are currently the routing wrappers."""
    return all(getattr(F, name) is _WRAPPERS[name] for name in ROUTED_FUNCTIONS)


def patch_refused_ops(enabled: bool = True) -> bool:
    """Install (``enabled=True``) or remove the routing of ``F.grid_sample`` / ``F.interpolate``.

    The wrappers route to the deterministic-backward ops only while
    ``torch.are_deterministic_algorithms_enabled()`` and only for covered arguments (module
    docstring); otherwise they call PyTorch's function, so installing them changes nothing
    outside deterministic mode. Idempotent; a function that someone else replaced after us is
    left alone on removal (with a warning in the log).

    Args:
        enabled: ``True`` installs, ``False`` restores PyTorch's functions.

    Returns:
        Whether the routing was installed before the call (to restore it later).

    Raises:
        TypeError: ``enabled`` is not a bool.

    Example::

        >>> previous = patch_refused_ops(True)
        >>> refused_ops_patched()
        True
        >>> _ = patch_refused_ops(previous)
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"patch_refused_ops: enabled must be a bool, got {enabled!r}")
    with _lock:
        previous = refused_ops_patched()
        for name in ROUTED_FUNCTIONS:
            current = getattr(F, name)
            if enabled:
                if current is not _WRAPPERS[name]:
                    if current is not _ORIGINALS[name]:
                        log.warning(
                            "patch_refused_ops: F.%s was already replaced by %r; routing over it", name, current
                        )
                    setattr(F, name, _WRAPPERS[name])
            elif current is _WRAPPERS[name]:
                setattr(F, name, _ORIGINALS[name])
            elif current is not _ORIGINALS[name]:
                log.warning("patch_refused_ops: F.%s was replaced by %r after patching; left as is", name, current)
        return previous


@contextlib.contextmanager
def refused_ops_routing(enabled: bool = True) -> Iterator[None]:
    """Context manager: :func:`patch_refused_ops` ``(enabled)`` inside, the previous state after.

    Example::

        >>> with refused_ops_routing():
        ...     refused_ops_patched()
        True
    """
    previous = patch_refused_ops(enabled)
    try:
        yield
    finally:
        patch_refused_ops(previous)
