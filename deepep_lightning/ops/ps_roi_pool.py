"""Deterministic backward of torchvision's ``ps_roi_pool`` (position-sensitive RoI pooling), routed at the dispatcher.

torchvision's CUDA ``_ps_roi_pool_backward`` adds ``grad / bin_area`` into every pixel of each bin's
rectangle with float ``atomicAdd`` and refuses deterministic mode. The rectangles depend on the RoI
alone, and bin ``b`` of output channel ``c`` feeds input channel ``c * PH * PW + b`` (the forward's
``channel_mapping`` always holds that).

``torch.ops.deepep_lightning.ps_roi_pool_backward`` (``extensions/csrc/roi_tiles.h``) writes every
``grad_input`` element once: a tile of pixels of one bin's plane lists, in RoI order, the bins whose rectangle
(torchvision's formulas: ``roundf`` of the scaled box, bins ``[floor(ph * bin_h), ceil((ph + 1) * bin_h))``
offset and clipped to ``[0, H]``) reaches it, and each pixel sums its terms in that order, the order of
torchvision's CPU kernel, whose float32 and float64 bits it gives. No atomics, no host synchronisation (it runs
inside CUDA-graph capture), the same bits on the CPU and CUDA.

Covered: float16/bfloat16/float32/float64 (16-bit terms summed in float, rounded once), empty RoI lists,
non-contiguous gradients. Without torchvision nothing is registered.
"""

import torch
from torch import Tensor

from deepep_lightning.ops import _torchvision_entry
from deepep_lightning.ops._guards import FLOAT_DTYPES, kernels_reason, register_fakes
from deepep_lightning.ops._routes import Route, register_route

__all__ = ["ps_roi_pool_backward", "ps_roi_pool_backward_unsupported_reason"]

_OP = "ps_roi_pool_backward"


def ps_roi_pool_backward_unsupported_reason(
    grad: Tensor,
    rois: Tensor,
    channel_mapping: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    batch_size: int,
    channels: int,
    height: int,
    width: int,
) -> str | None:
    """Why :func:`ps_roi_pool_backward` leaves these arguments to torchvision, or ``None``. Metadata only."""
    if not all(isinstance(tensor, Tensor) for tensor in (grad, rois, channel_mapping)):
        return "grad, rois and channel_mapping must be torch.Tensor"
    if torch.overrides.has_torch_function_variadic(grad, rois, channel_mapping):
        return "tensor subclasses with __torch_function__ are left to torchvision"
    if grad.dtype not in FLOAT_DTYPES or rois.dtype != grad.dtype:
        return f"dtype {grad.dtype} (rois {rois.dtype}) is not one of {list(FLOAT_DTYPES)} for both"
    if channel_mapping.dtype not in (torch.int32, torch.int64) or channel_mapping.shape != grad.shape:
        return f"channel_mapping must be int32/int64 of grad's shape {tuple(grad.shape)}"
    sizes = (pooled_height, pooled_width, batch_size, channels, height, width)
    if not all(isinstance(size, int) and not isinstance(size, bool) for size in sizes):
        return f"sizes {sizes!r} must be ints"
    if pooled_height <= 0 or pooled_width <= 0 or min(batch_size, channels, height, width) < 0:
        return f"pooled sizes must be positive and batch_size, channels, height, width >= 0, got {sizes!r}"
    bins = pooled_height * pooled_width
    if channels % bins != 0:
        return f"channels {channels} is not a multiple of pooled_height * pooled_width = {bins}"
    if grad.dim() != 4 or tuple(grad.shape[1:]) != (channels // bins, pooled_height, pooled_width):
        return f"grad of shape {tuple(grad.shape)} is not [K, {channels // bins}, {pooled_height}, {pooled_width}]"
    if rois.dim() != 2 or tuple(rois.shape) != (grad.shape[0], 5):
        return f"rois of shape {tuple(rois.shape)} is not [{grad.shape[0]}, 5]"
    if not grad.device == rois.device == channel_mapping.device:
        return "grad, rois and channel_mapping are on different devices"
    return kernels_reason(grad)


def _route(grad, rois, channel_mapping, spatial_scale, pooled_height, pooled_width, *shape):
    return torch.ops.deepep_lightning.ps_roi_pool_backward.default(
        grad, rois, float(spatial_scale), pooled_height, pooled_width, *shape
    )


def ps_roi_pool_backward(
    grad: Tensor,
    rois: Tensor,
    channel_mapping: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    batch_size: int,
    channels: int,
    height: int,
    width: int,
) -> Tensor:
    """``torchvision::_ps_roi_pool_backward`` (same arguments, same result to rounding), deterministic.

    Args:
        grad: ``[K, C / (PH * PW), PH, PW]``, the gradient of ``ps_roi_pool``'s output.
        rois: ``[K, 5]`` boxes ``(batch index, x1, y1, x2, y2)``, ``grad``'s dtype and device.
        channel_mapping: the forward's input channels (not read: always ``c * PH * PW + bin``).
        spatial_scale, pooled_height, pooled_width: as in ``ps_roi_pool``.
        batch_size, channels, height, width: the shape ``[N, C, H, W]`` of ``ps_roi_pool``'s input.

    Returns:
        ``[N, C, H, W]``, the gradient of ``ps_roi_pool``'s input.

    Raises:
        ValueError: arguments the kernel does not take (the reason names them).

    Example::

        >>> grad = torch.ones(1, 1, 1, 1)
        >>> rois = torch.tensor([[0.0, 0.0, 0.0, 2.0, 2.0]])
        >>> mapping = torch.zeros(1, 1, 1, 1, dtype=torch.int32)
        >>> ps_roi_pool_backward(grad, rois, mapping, 1.0, 1, 1, 1, 1, 3, 3)[0, 0]
        tensor([[0.2500, 0.2500, 0.0000],
                [0.2500, 0.2500, 0.0000],
                [0.0000, 0.0000, 0.0000]])
    """
    args = (
        grad,
        rois,
        channel_mapping,
        spatial_scale,
        pooled_height,
        pooled_width,
        batch_size,
        channels,
        height,
        width,
    )
    reason = ps_roi_pool_backward_unsupported_reason(*args)
    if reason is not None:
        raise ValueError(f"{_OP}: {reason}")
    return _route(*args)


def _fake_ps_roi_pool_backward(grad, rois, spatial_scale, pooled_height, pooled_width, batch, channels, height, width):
    return grad.new_empty((batch, channels, height, width))


register_fakes({"deepep_lightning::ps_roi_pool_backward": _fake_ps_roi_pool_backward})

if _torchvision_entry.torchvision_ops_available():
    register_route(
        Route("_ps_roi_pool_backward", _route, ps_roi_pool_backward_unsupported_reason, namespace="torchvision")
    )
