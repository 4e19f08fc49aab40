"""Where a backward op's forward ran: the module and the call that created its autograd node.

In backward, autograd runs a node's ops from the engine, outside every module's ``forward``; a module
tracker then names whichever module's backward hook ran last, which is not the module that called the op.
:class:`ForwardOrigins` is a ``TorchFunctionMode`` that watches the forward: for every torch function whose
output carries an autograd node (``grad_fn``), it records that node's origin: the innermost module, the
user's frames and the two innermost frames outside torch (the library lines that made the call, such as
torchvision's RAFT correlation lookup, ``index_pyramid``, calling ``F.grid_sample`` through a helper). A
dispatch mode that sees an op in backward looks its current node up with :meth:`ForwardOrigins.origin_of`.

The nodes are held until the mode is dropped (a log's lifetime), so their identity stays stable.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from deepep_lightning.audit._provenance import innermost_module

__all__ = ["ForwardOrigin", "ForwardOrigins"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_AUDIT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


@dataclasses.dataclass(frozen=True)
class ForwardOrigin:
    """The forward call that created an autograd node."""

    module_path: str | None
    frames: list
    caller: str | None  # "file:line in function" of the two innermost frames outside torch, innermost first


_CALLER_DEPTH = 2  # a library's helper and the line that called it (RAFT: _utils.grid_sample <- index_pyramid)


def _caller(frame: types.FrameType | None) -> str | None:
    calls: list[str] = []
    while frame is not None and len(calls) < _CALLER_DEPTH:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith((_TORCH_DIR, _AUDIT_DIR)) and not filename.startswith("<"):
            calls.append(f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(calls) or None


class ForwardOrigins(TorchFunctionMode):
    """Record the forward origin of every autograd node made while the mode is on.

    Args:
        tracker: the ``ModTracker`` whose innermost module names the forward's module (None: no path).
        user_frames: returns the user's frames of the current call (the op-hash log's own rule).
    """

    def __init__(self, tracker: Any, user_frames: Callable[[], list]) -> None:
        super().__init__()
        self._tracker = tracker
        self._user_frames = user_frames
        self._origins: dict[Any, ForwardOrigin] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch._C._current_autograd_node() is not None:
            return out  # a backward's own calls (double backward aside) create no node worth naming
        origin: ForwardOrigin | None = None
        for value in tree_flatten(out)[0]:
            node = getattr(value, "grad_fn", None) if isinstance(value, torch.Tensor) else None
            if node is None or node in self._origins:
                continue
            if origin is None:
                origin = ForwardOrigin(innermost_module(self._tracker), self._user_frames(), _caller(sys._getframe(1)))
            self._origins[node] = origin
        return out

    def origin_of(self, node: Any) -> ForwardOrigin | None:
        """The origin recorded for an autograd node, or None (a node made outside the mode)."""
        return self._origins.get(node) if node is not None else None
