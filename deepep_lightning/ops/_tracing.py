"""What ``torch.compile`` needs to trace a routed aten op whose PyTorch decomposition refuses deterministic mode.

Dynamo propagates fake tensors through every op it traces. An op without a Python meta function (``max_unpool2d``,
``max_unpool3d``) gets its fake result from PyTorch's Python decomposition, which calls
``alert_not_deterministic`` and so raises in deterministic mode while tracing, before any kernel (routed or not)
could run; inductor would then also decompose the op into the ``index_put`` that refuses it. While a route is
installed, :func:`install_shape_function` gives the op a shape function instead: fake tensors use it (as a Python
meta function, and as the op's Meta kernel, which dynamo's Python dispatcher consults), and the op's
decompositions are set aside — inductor's (in its table and in the copy of the table inductor caches after its
first compile; where inductor is not imported yet, its table will be built without the op) and PyTorch's
registered one, which inductor checks before it falls back to an aten kernel (with
``CI`` set in the environment it refuses the fallback while a decomposition is registered) — so the compiled graph
calls the aten op itself, whose CUDA kernel the route overrides.
:func:`remove_shape_function` puts everything back.

These are PyTorch internals (``torch._decomp.meta_table``, ``OpOverload.py_kernels``,
``torch._decomp.decomposition_table``, inductor's decomposition table). Where one is missing, the op traces as
PyTorch traces it (and raises as before), with one debug line.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["install_shape_function", "installed_shape_functions", "remove_shape_function"]

log = logging.getLogger(__name__)

_MISSING = object()
# aten op name -> (op overload, previous meta_table entry, previous Meta py-kernel, previous decompositions, one per
# table of _decomposition_tables())
_saved: dict[str, tuple[Any, Any, Any, list[Any]]] = {}


_INDUCTOR_DECOMPOSITION = "torch._inductor.decomposition"


def _decomposition_tables() -> list[dict]:
    """PyTorch's registered decompositions, then inductor's table where inductor has been imported.

    Inductor builds its table from PyTorch's registered decompositions when it is imported, so an op set aside
    before that import is missing from inductor's table too: a route does not import inductor (0.3-0.5 s of
    every run's start) to edit a table nobody has built yet.
    """
    from torch._decomp import decomposition_table

    inductor = sys.modules.get(_INDUCTOR_DECOMPOSITION)
    if inductor is None or not isinstance(getattr(inductor, "decompositions", None), dict):
        return [decomposition_table]
    return [decomposition_table, inductor.decompositions]


def _forget_inductor_copies() -> None:
    """Drop inductor's cached copy of its decomposition table, so the next compile reads the table as it is now."""
    inductor = sys.modules.get(_INDUCTOR_DECOMPOSITION)
    cache_clear = getattr(getattr(inductor, "fast_random_decomps", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


def install_shape_function(aten_op: str, shape_function: Callable[..., torch.Tensor]) -> bool:
    """Make ``torch.ops.aten.<aten_op>`` trace with ``shape_function``; returns whether it is installed.

    ``shape_function`` takes the op's arguments (fake tensors) and returns an empty tensor of the output's
    shape, dtype and device, without computing or alerting.
    """
    if aten_op in _saved:
        return True
    try:
        name, _, overload = aten_op.partition(".")
        op = getattr(getattr(torch.ops.aten, name), overload or "default")
        from torch._decomp import meta_table

        meta_key = torch._C.DispatchKey.Meta
        previous_kernel = op.py_kernels.get(meta_key, _MISSING)
        previous_meta = meta_table.get(op, _MISSING)
        previous_decompositions = [table.pop(op, _MISSING) for table in _decomposition_tables()]
        meta_table[op] = shape_function
        op.py_kernels[meta_key] = shape_function
        op._dispatch_cache.clear()
        _forget_inductor_copies()
    except (AttributeError, ImportError, TypeError) as error:  # another PyTorch's internals
        log.debug("routes: %s keeps PyTorch's tracing (%s: %s)", aten_op, type(error).__name__, error)
        return False
    _saved[aten_op] = (op, previous_meta, previous_kernel, previous_decompositions)
    return True


def _restore(table: dict, key: Any, previous: Any) -> None:
    if previous is _MISSING:
        table.pop(key, None)
    else:
        table[key] = previous


def remove_shape_function(aten_op: str) -> None:
    """Undo :func:`install_shape_function` for ``aten_op`` (no-op when it is not installed)."""
    saved = _saved.pop(aten_op, None)
    if saved is None:
        return
    op, previous_meta, previous_kernel, previous_decompositions = saved
    from torch._decomp import meta_table

    _restore(meta_table, op, previous_meta)
    _restore(op.py_kernels, torch._C.DispatchKey.Meta, previous_kernel)
    tables = _decomposition_tables()
    if len(tables) > len(previous_decompositions):  # inductor imported while the op was set aside: it copied
        previous_decompositions = [*previous_decompositions, previous_decompositions[0]]  # PyTorch's entry
    for table, previous in zip(tables, previous_decompositions):
        _restore(table, op, previous)
    op._dispatch_cache.clear()
    _forget_inductor_copies()


def installed_shape_functions() -> list[str]:
    """The aten ops that trace with a route's shape function now."""
    return sorted(_saved)
