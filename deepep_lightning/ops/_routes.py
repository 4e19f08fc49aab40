"""Route refused dispatcher ops to deterministic kernels at the dispatcher's CUDA key.

PyTorch's CUDA kernels for ops such as ``nll_loss2d_forward`` (what 4-D ``F.cross_entropy`` reaches
inside C++) or ``_adaptive_avg_pool2d_backward`` raise under ``torch.use_deterministic_algorithms(True)``
because they accumulate with float ``atomicAdd``. A :class:`Route` names such an op and a deterministic
replacement; :func:`enable_routes` overrides the op's CUDA kernel (``torch.library.Library("aten",
"IMPL")``, one ``Library`` per namespace: torchvision's ops are routed the same way in ``torchvision``)
with a thin wrapper that

* calls ``route.deterministic(*args, **kwargs)`` when ``torch.are_deterministic_algorithms_enabled()``
  (``warn_only`` included) and ``route.covers(*args, **kwargs)`` is ``None``;
* otherwise calls PyTorch's original CUDA kernel, captured with ``torch.library.get_kernel`` before the
  override: same result, and PyTorch's own errors (its deterministic-mode error included).

Because the override sits at the CUDA key, below autograd, every caller reaches it: ``F.*`` and
``torch.*`` functions, C++ composites (``cross_entropy_loss``), references taken at import, TorchScript,
the aten fallbacks of ``torch.compile``/inductor. The wrapper is host-side Python only (no sync, no read
of tensor values), so it also runs inside CUDA-graph capture. ``covers`` must inspect only metadata.

:func:`disable_routes` destroys the ``Library`` objects, which puts the original registrations back. Op
modules call :func:`register_route` at import; a route registered while routing is on is installed at
once. Enabling and disabling are idempotent and thread-safe.

Example::

    >>> from deepep_lightning.ops._routes import enable_routes, disable_routes, routes_enabled
    >>> was = enable_routes()
    >>> routes_enabled()
    True
    >>> _ = disable_routes()
"""

import logging
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepep_lightning.ops import _tracing

__all__ = [
    "Route",
    "register_route",
    "registered_routes",
    "enable_routes",
    "disable_routes",
    "routes_enabled",
    "installed_ops",
]

log = logging.getLogger(__name__)

#: The dispatch key whose kernels refuse deterministic mode; tests install at "CPU" to exercise routing.
DEFAULT_DISPATCH_KEY = "CUDA"
_OVERRIDE_WARNING = "Overriding a previously registered kernel"


def _always_covered(*args, **kwargs) -> str | None:
    return None


@dataclass(frozen=True)
class Route:
    """One dispatcher op served by a deterministic implementation in deterministic mode.

    Attributes:
        aten_op: the op's name in ``namespace``, ``"name"`` for the default overload or
            ``"name.overload"`` (e.g. ``"nll_loss2d_forward"``, ``"_adaptive_avg_pool2d_backward"``).
        deterministic: called with the aten op's arguments (as the dispatcher passes them), returns its
            outputs, computed deterministically.
        covers: called with the same arguments; returns a reason string when a case is not covered
            (the original kernel then runs), ``None`` when ``deterministic`` handles it. Metadata only.
        shape_function: for an op whose PyTorch decomposition refuses deterministic mode while
            ``torch.compile`` traces it: returns an empty tensor of the output's shape from the op's
            arguments; while the route is installed the op traces with it and the compiled graph calls the
            aten op, which the route serves (:mod:`deepep_lightning.ops._tracing`). None: PyTorch's tracing.
            Only for ``aten`` ops.
        namespace: the op's library, ``"aten"`` (default) or another one whose kernels refuse
            deterministic mode (``"torchvision"``).
        on_install: called with ``True`` once the route is installed and ``False`` once it is removed:
            for a Python entry point that must reach the routed op while routing is on
            (:mod:`deepep_lightning.ops._torchvision_entry`). None: nothing.
    """

    aten_op: str
    deterministic: Callable
    covers: Callable[..., str | None] = _always_covered
    shape_function: Callable[..., Any] | None = None
    namespace: str = "aten"
    on_install: Callable[[bool], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.aten_op, str) or not self.aten_op or "::" in self.aten_op:
            raise ValueError(
                f"Route: aten_op must be an aten op name without namespace ('name' or 'name.overload'), "
                f"got {self.aten_op!r}"
            )
        if not callable(self.deterministic):
            raise TypeError(f"Route({self.aten_op!r}): deterministic must be callable, got {self.deterministic!r}")
        if not callable(self.covers):
            raise TypeError(f"Route({self.aten_op!r}): covers must be callable, got {self.covers!r}")
        if self.shape_function is not None and not callable(self.shape_function):
            raise TypeError(
                f"Route({self.aten_op!r}): shape_function must be callable or None, got {self.shape_function!r}"
            )
        if not isinstance(self.namespace, str) or not self.namespace.isidentifier():
            raise ValueError(
                f"Route({self.aten_op!r}): namespace must be a library name such as 'aten', got {self.namespace!r}"
            )
        if self.shape_function is not None and self.namespace != "aten":
            raise ValueError(
                f"Route({self.aten_op!r}): shape_function is only for aten ops, got namespace {self.namespace!r}"
            )
        if self.on_install is not None and not callable(self.on_install):
            raise TypeError(f"Route({self.aten_op!r}): on_install must be callable or None, got {self.on_install!r}")

    @property
    def qualified_name(self) -> str:
        """``"<namespace>::<aten_op>"``, as ``torch.library.get_kernel`` takes it."""
        return f"{self.namespace}::{self.aten_op}"

    @property
    def key(self) -> str:
        """The route's name in the registry: ``aten_op`` for an aten op, the qualified name otherwise."""
        return self.aten_op if self.namespace == "aten" else self.qualified_name


_lock = threading.RLock()
_routes: dict[str, Route] = {}
_libraries: dict[str, torch.library.Library] = {}  # namespace -> its IMPL library, while routing is on
_enabled = False
_dispatch_key: str | None = None
_installed: dict[str, str] = {}  # route key -> dispatch key it is installed at
# Set while a route's deterministic implementation runs on this thread: an aten op it calls (the CPU
# kernels call PyTorch's own) reaches PyTorch's kernel, not the route again.
_inside = threading.local()


def route_kernel(route: Route, original: Any) -> Callable:
    """The kernel installed for ``route``: ``fn(keyset, *args, **kwargs)``.

    Inside ``route.deterministic`` (same thread) every routed op runs its original kernel.
    ``original`` is PyTorch's kernel (``torch._C._SafeKernelFunction``); anything with
    ``call_boxed(keyset, *args, **kwargs)`` works, which lets tests drive this function directly.
    """

    def kernel(keyset, *args, **kwargs):
        if (
            not getattr(_inside, "route", False)
            and torch.are_deterministic_algorithms_enabled()
            and route.covers(*args, **kwargs) is None
        ):
            _inside.route = True
            try:
                return route.deterministic(*args, **kwargs)
            finally:
                _inside.route = False
        return original.call_boxed(keyset, *args, **kwargs)

    kernel.__name__ = f"deepep_route_{route.key.replace('.', '_').replace('::', '_')}"
    kernel.__qualname__ = kernel.__name__
    return kernel


def _install(route: Route) -> None:
    """Override ``route``'s op at ``_dispatch_key`` in its namespace's library (lock held, routing on)."""
    assert _enabled and _dispatch_key is not None
    try:
        original = torch.library.get_kernel(route.qualified_name, _dispatch_key)
    except Exception as error:  # noqa: BLE001 - an op without a kernel at this key stays PyTorch's
        log.debug("routes: %s has no %s kernel to route (%s); left alone", route.key, _dispatch_key, error)
        return
    library = _libraries.get(route.namespace)
    if library is None:
        library = _libraries[route.namespace] = torch.library.Library(route.namespace, "IMPL")
    with warnings.catch_warnings():
        # One per op: the override is the point (torch 2.11 warns, newer versions may not).
        warnings.filterwarnings("ignore", message=_OVERRIDE_WARNING, category=UserWarning)
        library.impl(route.aten_op, route_kernel(route, original), _dispatch_key, with_keyset=True)
    _installed[route.key] = _dispatch_key
    if route.shape_function is not None:
        _tracing.install_shape_function(route.aten_op, route.shape_function)
    if route.on_install is not None:
        route.on_install(True)


def register_route(route: Route) -> Route:
    """Add ``route`` to the registry (called at import of an op module); returns it.

    Registering an op again replaces its route (a reloaded module); when routing is on, the new route
    is installed at once.

    Raises:
        TypeError: ``route`` is not a :class:`Route`.
    """
    if not isinstance(route, Route):
        raise TypeError(f"register_route: route must be a deepep_lightning.ops._routes.Route, got {route!r}")
    with _lock:
        replaced = route.key in _routes
        _routes[route.key] = route
        if _enabled:
            if replaced:
                _reinstall()
            else:
                _install(route)
    return route


def registered_routes() -> dict[str, Route]:
    """A copy of the registry: route key (aten op name, or ``"namespace::name"``) -> :class:`Route`."""
    with _lock:
        return dict(_routes)


def installed_ops() -> dict[str, str]:
    """The ops whose kernel is overridden now: route key -> dispatch key (empty when routing is off)."""
    with _lock:
        return dict(_installed)


def routes_enabled() -> bool:
    """Whether :func:`enable_routes` is in effect."""
    return _enabled


def _reinstall() -> None:
    key = _dispatch_key
    assert key is not None  # set with _enabled, and callers hold routing on
    _destroy()
    _create(key)


def _create(dispatch_key: str) -> None:
    global _enabled, _dispatch_key
    _libraries["aten"] = torch.library.Library("aten", "IMPL")
    _enabled = True
    _dispatch_key = dispatch_key
    for route in _routes.values():
        _install(route)


def _destroy() -> None:
    global _enabled, _dispatch_key
    for library in _libraries.values():
        library._destroy()  # deregisters every override: the original kernels are back
    _libraries.clear()
    for aten_op in _tracing.installed_shape_functions():
        _tracing.remove_shape_function(aten_op)
    for key in _installed:
        route = _routes.get(key)
        if route is not None and route.on_install is not None:
            route.on_install(False)
    _enabled = False
    _dispatch_key = None
    _installed.clear()


def enable_routes(dispatch_key: str = DEFAULT_DISPATCH_KEY) -> bool:
    """Override the kernels of every registered route at ``dispatch_key``; returns the previous state.

    Args:
        dispatch_key: ``"CUDA"`` (default), the key whose kernels refuse deterministic mode. Tests pass
            ``"CPU"`` to drive the same wrappers without a GPU. Enabling at another key than the one in
            effect moves the overrides there.

    Returns:
        Whether routing was on before the call.

    Raises:
        TypeError: ``dispatch_key`` is not a str.
    """
    if not isinstance(dispatch_key, str):
        raise TypeError(f"enable_routes: dispatch_key must be a str such as 'CUDA', got {dispatch_key!r}")
    with _lock:
        previous = _enabled
        if previous and _dispatch_key == dispatch_key:
            return True
        _destroy()
        _create(dispatch_key)
        return previous


def disable_routes() -> bool:
    """Remove every override (PyTorch's original kernels run again); returns the previous state."""
    with _lock:
        previous = _enabled
        _destroy()
        return previous
