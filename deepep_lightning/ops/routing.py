"""The user-facing switch for the deterministic kernels of refused ops: :func:`patch_refused_ops`.

Routing happens at the dispatcher (:mod:`deepep_lightning.ops._routes`): every op module of
``deepep_lightning.ops`` registers a :class:`~deepep_lightning.ops._routes.Route` for each ``aten``
op whose CUDA kernel PyTorch refuses under ``torch.use_deterministic_algorithms(True)``
(:data:`ROUTED_ATEN_OPS` once the package is imported). While routing is on, those ops' CUDA kernels
run the deterministic implementation when deterministic mode is on and the case is covered, and
PyTorch's original kernel otherwise, so nothing changes outside deterministic mode, and an uncovered
case keeps PyTorch's own error. Every caller is covered: ``F.cross_entropy`` (which reaches
``nll_loss2d_forward`` inside C++), ``torch.grid_sampler``, references taken at import, TorchScript,
``torch.compile``'s aten fallbacks, CUDA-graph capture.

Routing is process-global, idempotent and reversible; :func:`refused_ops_routing` scopes it.
"""

import contextlib
import importlib
import pkgutil
from collections.abc import Iterator

from deepep_lightning.ops import _routes
from deepep_lightning.ops.extension_loader import extension_available

__all__ = ["patch_refused_ops", "refused_ops_patched", "refused_ops_routing", "routed_aten_ops"]

_OPS_PACKAGE = "deepep_lightning.ops"


def _import_route_modules() -> None:
    """Import every public module of ``deepep_lightning.ops``: an op module registers its routes at import."""
    package = importlib.import_module(_OPS_PACKAGE)
    for module in pkgutil.iter_modules(package.__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{_OPS_PACKAGE}.{module.name}")


def routed_aten_ops() -> list[str]:
    """The aten ops that :func:`patch_refused_ops` routes (sorted)."""
    _import_route_modules()
    return sorted(_routes.registered_routes())


def refused_ops_patched() -> bool:
    """Whether the dispatcher routing of refused ops is on."""
    return _routes.routes_enabled()


def patch_refused_ops(enabled: bool = True) -> bool:
    """Turn the dispatcher routing of refused ops on (``enabled=True``) or off.

    Turning it on builds the extension first (once per process, so that no build runs inside a
    kernel call); without the extension every route hands its op to PyTorch. Idempotent.

    Args:
        enabled: ``True`` routes, ``False`` puts PyTorch's kernels back.

    Returns:
        Whether the routing was on before the call (to restore it later).

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
    if not enabled:
        return _routes.disable_routes()
    _import_route_modules()
    extension_available()
    return _routes.enable_routes()


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
