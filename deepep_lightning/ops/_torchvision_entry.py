"""torchvision's Python ``roi_align`` reaching its dispatcher op while the ``roi_align`` route is installed.

``torchvision.ops.roi_align`` checks ``torch.are_deterministic_algorithms_enabled()`` and, on CUDA,
calls its pure-PyTorch ``_roi_align`` instead of ``torch.ops.torchvision.roi_align``: deterministic, but
with ``[K, C, PH, PW, IY, IX]`` intermediates (tens of GiB with adaptive sampling) and several times the
step time of a detection model. That choice is made in Python, before the dispatcher, so the route on
``torchvision::_roi_align_backward`` (:mod:`deepep_lightning.ops.roi_align`) would never be reached.

While the route is installed (:func:`use_dispatcher_roi_align` ``(True)``, called by the route's
``on_install``), every module-level reference to torchvision's function (``torchvision.ops.roi_align``,
the ``roi_align`` of ``torchvision.ops.roi_align``'s module, ``torchvision.ops.poolers``,
``torchvision.models.detection.roi_heads``, and any user module that imported it by name) is replaced
with :func:`roi_align`, which takes torchvision's dispatcher path in every mode (same argument handling,
same op, so the same forward result); removing the route puts the original back everywhere
(:class:`~deepep_lightning.ops._python_entry.PythonEntry`).
"""

import torch
from torch import Tensor
from torch.nn.modules.utils import _pair

from deepep_lightning.ops._python_entry import PythonEntry

try:  # an optional dependency; at module level so that torch.compile traces roi_align without an import
    from torchvision.ops._utils import check_roi_boxes_shape, convert_boxes_to_roi_format
except Exception:  # noqa: BLE001 - without a working torchvision nothing here is installed
    check_roi_boxes_shape = convert_boxes_to_roi_format = None

__all__ = ["dispatcher_roi_align_in_use", "roi_align", "torchvision_ops_available", "use_dispatcher_roi_align"]


def torchvision_ops_available() -> bool:
    """Whether torchvision imports and has its compiled ops (``torch.ops.torchvision.roi_align``)."""
    try:
        import torchvision.ops  # noqa: F401 - registers torch.ops.torchvision
        from torchvision.extension import _has_ops
    except Exception:  # noqa: BLE001 - an optional dependency: any import failure means "not available"
        return False
    return bool(_has_ops())


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
    half_on_cuda = isinstance(input, Tensor) and input.is_cuda and input.dtype in (torch.float16, torch.bfloat16)
    if torch.jit.is_scripting() or not isinstance(input, Tensor) or input.is_quantized or half_on_cuda:
        return _ENTRY.original(input, boxes, output_size, spatial_scale, sampling_ratio, aligned)
    check_roi_boxes_shape(boxes)
    rois = boxes if isinstance(boxes, Tensor) else convert_boxes_to_roi_format(boxes)
    pooled_height, pooled_width = _pair(output_size)
    return torch.ops.torchvision.roi_align(
        input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned
    )


_ENTRY = PythonEntry("torchvision.ops.roi_align", "roi_align", roi_align)


def use_dispatcher_roi_align(enabled: bool) -> None:
    """Replace torchvision's Python ``roi_align`` with :func:`roi_align` everywhere (``True``) or undo it."""
    if torchvision_ops_available():
        _ENTRY.use(enabled)


def dispatcher_roi_align_in_use() -> bool:
    """Whether :func:`use_dispatcher_roi_align` ``(True)`` is in effect."""
    return _ENTRY.in_use
