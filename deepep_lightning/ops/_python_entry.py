"""A Python function that picks a slow deterministic path before the dispatcher, replaced while its route is on.

Two public functions decide in Python, from ``torch.are_deterministic_algorithms_enabled()``, to leave
their dispatcher op for a pure-PyTorch path: ``torchvision.ops.roi_align`` (CUDA, to ``_roi_align`` with
``[K, C, PH, PW, IY, IX]`` intermediates) and ``torch.nn.functional.interpolate`` (CUDA bilinear, to an
index-based decomposition whose backward is a sorted ``index_put_``). A route on the op they leave is then
never reached. A :class:`PythonEntry` replaces such a function, while its route is installed, with one
that reaches the routed op, in every module global that holds it (the function's own module, modules that
imported it by name); removing the route puts the original back everywhere.

Each module is scanned once per entry, when the entry is first used after the module's import (a full scan
of ``sys.modules`` costs ~0.05 s); references held elsewhere (a ``functools.partial``, an attribute of an
object), or bound into an already scanned module later, keep the original.
"""

import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["PythonEntry"]


class PythonEntry:
    """``module.name`` replaced by ``replacement`` everywhere while :meth:`use` ``(True)`` is in effect.

    Args:
        module: the defining module's name (``"torch.nn.functional"``); it must be imported before
            :meth:`use` or :attr:`original` is called.
        name: the function's attribute in that module (``"interpolate"``).
        replacement: the function that takes the function's place; it calls :attr:`original` (or a
            reference its own module keeps: that module is never rewritten) for the cases it leaves alone.
    """

    def __init__(self, module: str, name: str, replacement: Callable[..., Any]) -> None:
        self._module = module
        self._name = name
        self._replacement = replacement
        self._lock = threading.Lock()
        self._original: Callable[..., Any] | None = None
        self._in_use = False
        self._scanned: set[str] = set()  # modules whose globals were looked at
        self._holders: list[tuple[dict[str, Any], str]] = []  # (module globals, name) that held either function

    @property
    def original(self) -> Callable[..., Any]:
        """The function as its module defined it (read once, before any replacement)."""
        if self._original is None:
            function = vars(sys.modules[self._module])[self._name]
            if function is self._replacement:
                raise RuntimeError(f"PythonEntry: {self._module}.{self._name} was replaced before it was read")
            self._original = function
        return self._original

    @property
    def in_use(self) -> bool:
        """Whether :meth:`use` ``(True)`` is in effect."""
        return self._in_use

    def use(self, enabled: bool) -> None:
        """Replace the function with the replacement everywhere (``True``) or put the original back."""
        with self._lock:
            original = self.original
            if enabled == self._in_use:
                return
            if enabled:
                self._replace_everywhere(original, self._replacement)
            else:
                self._replace_everywhere(self._replacement, original)
            self._in_use = enabled

    def _scan_new_modules(self) -> None:
        """Record every global, of a module not scanned before, that holds either function."""
        wanted = {id(self._original), id(self._replacement)}  # a set lookup per global: the scan's inner loop
        own = self._replacement.__module__  # it holds the original on purpose, to call it
        for module_name, module in list(sys.modules.items()):
            if module_name in self._scanned or module is None or module_name == own:
                continue
            self._scanned.add(module_name)
            try:
                namespace = vars(module)
                names = [attribute for attribute, value in list(namespace.items()) if id(value) in wanted]
            except Exception:  # noqa: BLE001 - lazy or proxy modules may refuse introspection; they are left alone
                continue
            self._holders.extend((namespace, attribute) for attribute in names)

    def _replace_everywhere(self, old: Callable[..., Any], new: Callable[..., Any]) -> None:
        self._scan_new_modules()
        for namespace, attribute in self._holders:
            if namespace.get(attribute) is old:
                namespace[attribute] = new
