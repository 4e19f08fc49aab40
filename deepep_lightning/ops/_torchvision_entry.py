"""torchvision's Python ``roi_align`` reaching its dispatcher op while the ``roi_align`` route is installed.

``torchvision.ops.roi_align`` checks ``torch.are_deterministic_algorithms_enabled()`` and, on CUDA,
calls its pure-PyTorch ``_roi_align`` instead of ``torch.ops.torchvision.roi_align``: deterministic, but
with ``[K, C, PH, PW, IY, IX]`` intermediates (tens of GiB with adaptive sampling) and several times the
step time of a detection model. That choice is made in Python, before the dispatcher, so the route on
``torchvision::_roi_align_backward`` (:mod:`deepep_lightning.ops.roi_align`) would never be reached.

This module is the package's one patch of a Python attribute, and it exists for that reason alone.
While the route is installed (:func:`use_dispatcher_roi_align` ``(True)``, called by the route's
``on_install``), every module-level reference to torchvision's function (``torchvision.ops.roi_align``,
the ``roi_align`` of ``torchvision.ops.roi_align``'s module, ``torchvision.ops.poolers``,
``torchvision.models.detection.roi_heads``, and any user module that imported it by name) is replaced
with :func:`roi_align`, which takes torchvision's dispatcher path in every mode (same argument handling,
same op, so the same forward result); removing the route puts the original back everywhere
(``use_dispatcher_roi_align(False)``). Each module is scanned once, when routing first turns on after
its import; references held elsewhere than in a module's globals (a ``functools.partial``, an attribute
of an object), or bound into an already scanned module later, keep the original.
"""

import sys
import threading
from typing import Any

import torch
from torch import Tensor
from torch.nn.modules.utils import _pair

try:  # an optional dependency; at module level so that torch.compile traces roi_align without an import
    from torchvision.ops._utils import check_roi_boxes_shape, convert_boxes_to_roi_format
except Exception:  # noqa: BLE001 - without a working torchvision nothing here is installed
    check_roi_boxes_shape = convert_boxes_to_roi_format = None

__all__ = ["dispatcher_roi_align_in_use", "roi_align", "torchvision_ops_available", "use_dispatcher_roi_align"]

_lock = threading.Lock()
_state: dict[str, Any] = {"original": None, "in_use": False}
_scanned: set[str] = set()  # modules whose globals were looked at
_holders: list[tuple[dict[str, Any], str]] = []  # (module globals, name) that held either function


def torchvision_ops_available() -> bool:
    """Whether torchvision imports and has its compiled ops (``torch.ops.torchvision.roi_align``)."""
    try:
        import torchvision.ops  # noqa: F401 - registers torch.ops.torchvision
        from torchvision.extension import _has_ops
    except Exception:  # noqa: BLE001 - an optional dependency: any import failure means "not available"
        return False
    return bool(_has_ops())


def _original_roi_align() -> Any:
    if _state["original"] is None:
        module = sys.modules["torchvision.ops.roi_align"]
        function = vars(module)["roi_align"]
        _state["original"] = function if function is not roi_align else None
    return _state["original"]


def roi_align(
    input: Tensor,
    boxes: Tensor | list[Tensor],
    output_size: int | tuple[int, int] | list[int],
    spatial_scale: float = 1.0,
    sampling_ratio: int = -1,
    aligned: bool = False,
) -> Tensor:
    """``torchvision.ops.roi_align`` that always calls ``torch.ops.torchvision.roi_align``.

    Quantized inputs, TorchScript and float16/bfloat16 CUDA inputs (the route covers float32/float64 there, so
    torchvision's own choice stays: its pure-PyTorch path in deterministic mode) go to torchvision's function.
    """
    original = _state["original"]
    half_on_cuda = isinstance(input, Tensor) and input.is_cuda and input.dtype in (torch.float16, torch.bfloat16)
    if torch.jit.is_scripting() or not isinstance(input, Tensor) or input.is_quantized or half_on_cuda:
        return original(input, boxes, output_size, spatial_scale, sampling_ratio, aligned)
    check_roi_boxes_shape(boxes)
    rois = boxes if isinstance(boxes, Tensor) else convert_boxes_to_roi_format(boxes)
    pooled_height, pooled_width = _pair(output_size)
    return torch.ops.torchvision.roi_align(
        input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned
    )


def _scan_new_modules() -> None:
    """Record every global of a module not scanned before that holds torchvision's function or :func:`roi_align`.

    Each module is scanned once (a full scan of ``sys.modules`` costs ~0.1 s), so turning routing on and off
    again only looks at the modules imported since.
    """
    original = _state["original"]
    for name, module in list(sys.modules.items()):
        if name in _scanned or module is None or name == __name__:
            continue
        _scanned.add(name)
        try:
            namespace = vars(module)
            names = [
                attribute for attribute, value in list(namespace.items()) if value is original or value is roi_align
            ]
        except Exception:  # noqa: BLE001 - lazy or proxy modules may refuse introspection; they are left alone
            continue
        _holders.extend((namespace, attribute) for attribute in names)


def _replace_everywhere(old: Any, new: Any) -> None:
    """Point every recorded module global that is ``old`` at ``new``."""
    _scan_new_modules()
    for namespace, attribute in _holders:
        if namespace.get(attribute) is old:
            namespace[attribute] = new


def use_dispatcher_roi_align(enabled: bool) -> None:
    """Replace torchvision's Python ``roi_align`` with :func:`roi_align` everywhere (``True``) or undo it."""
    if not torchvision_ops_available():
        return
    with _lock:
        original = _original_roi_align()
        if original is None or enabled == _state["in_use"]:
            return
        if enabled:
            _replace_everywhere(original, roi_align)
        else:
            _replace_everywhere(roi_align, original)
        _state["in_use"] = enabled


def dispatcher_roi_align_in_use() -> bool:
    """Whether :func:`use_dispatcher_roi_align` ``(True)`` is in effect."""
    return bool(_state["in_use"])
