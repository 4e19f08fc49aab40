"""Deterministic backward of torchvision's ``roi_pool``, routed at the dispatcher.

torchvision's CUDA ``_roi_pool_backward`` adds each bin's gradient into ``grad_input`` at the bin's
argmax with float ``atomicAdd`` and refuses deterministic mode (``roi_pool_backward_kernel does not have a
deterministic implementation``). ``roi_pool`` is max pooling, so the target pixel of a bin depends on the
channel (the forward's per-channel ``argmax``): the backward is a scatter-add of ``grad[k, c, ph, pw]``
into plane ``(batch index of k) * C + c`` at position ``argmax[k, c, ph, pw]``. Bins without a pixel
(``argmax == -1``) add nothing.

``torch.ops.deepep_lightning.roi_pool_backward`` (``extensions/csrc/roi_tiles.h``) writes every
``grad_input`` element once: a tile of pixels of one image lists, in RoI order, the RoIs whose bins
(torchvision's formulas: ``round`` of the scaled box, bins ``[floor(ph * bin_h), ceil((ph + 1) * bin_h))``
offset and clipped) cover it, and each pixel adds the gradient of every bin that holds it and whose argmax it
is, in torchvision's CPU order (RoI, then bin), whose float32 and float64 bits it gives. A bin's maximum lies in
the bin, so the gather reads a bin's argmax only at the bin's pixels. No atomics, no host synchronisation
(CUDA-graph capturable), the same bits on the CPU and CUDA.

Covered: float16/bfloat16/float32/float64 (16-bit terms summed in float, rounded once), empty RoI lists,
non-contiguous gradients, any device of the extension. Without torchvision nothing is registered.
"""

import torch
from torch import Tensor

from deepep_lightning.ops import _torchvision_entry
from deepep_lightning.ops._guards import FLOAT_DTYPES, kernels_reason, register_fakes
from deepep_lightning.ops._routes import Route, register_route

__all__ = ["roi_pool_backward", "roi_pool_backward_unsupported_reason"]

_OP = "roi_pool_backward"
_INT32_LIMIT = 2**31 - 2


def roi_pool_backward_unsupported_reason(
    grad: Tensor,
    rois: Tensor,
    argmax: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    batch_size: int,
    channels: int,
    height: int,
    width: int,
) -> str | None:
    """Why :func:`roi_pool_backward` leaves these arguments to torchvision, or ``None``. Metadata only."""
    if not all(isinstance(tensor, Tensor) for tensor in (grad, rois, argmax)):
        return "grad, rois and argmax must be torch.Tensor"
    if torch.overrides.has_torch_function_variadic(grad, rois, argmax):
        return "tensor subclasses with __torch_function__ are left to torchvision"
    if grad.dtype not in FLOAT_DTYPES or rois.dtype != grad.dtype:
        return f"dtype {grad.dtype} (rois {rois.dtype}) is not one of {list(FLOAT_DTYPES)} for both"
    if argmax.dtype not in (torch.int32, torch.int64):
        return f"argmax dtype {argmax.dtype} is not int32 or int64"
    sizes = (pooled_height, pooled_width, batch_size, channels, height, width)
    if not all(isinstance(size, int) and not isinstance(size, bool) for size in sizes):
        return f"sizes {sizes!r} must be ints"
    if pooled_height <= 0 or pooled_width <= 0 or min(batch_size, channels, height, width) < 0:
        return f"pooled sizes must be positive and batch_size, channels, height, width >= 0, got {sizes!r}"
    if not isinstance(spatial_scale, float | int) or isinstance(spatial_scale, bool):
        return f"spatial_scale {spatial_scale!r} must be a float"
    if grad.dim() != 4 or tuple(grad.shape[1:]) != (channels, pooled_height, pooled_width):
        return f"grad of shape {tuple(grad.shape)} is not [K, {channels}, {pooled_height}, {pooled_width}]"
    if argmax.shape != grad.shape:
        return f"argmax of shape {tuple(argmax.shape)} is not grad's {tuple(grad.shape)}"
    if rois.dim() != 2 or tuple(rois.shape) != (grad.shape[0], 5):
        return f"rois of shape {tuple(rois.shape)} is not [{grad.shape[0]}, 5]"
    if height * width > _INT32_LIMIT:
        return "height * width must be below 2^31 - 1 (int32 argmax)"
    if not grad.device == rois.device == argmax.device:
        return f"grad, rois and argmax are on different devices ({grad.device}, {rois.device}, {argmax.device})"
    return kernels_reason(grad)


def roi_pool_backward(
    grad: Tensor,
    rois: Tensor,
    argmax: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    batch_size: int,
    channels: int,
    height: int,
    width: int,
) -> Tensor:
    """``torchvision::_roi_pool_backward`` (same arguments, same result to rounding), deterministic.

    Args:
        grad: ``[K, C, PH, PW]``, the gradient of ``roi_pool``'s output.
        rois: ``[K, 5]`` boxes ``(batch index, x1, y1, x2, y2)``, ``grad``'s dtype and device.
        argmax: ``[K, C, PH, PW]`` int32/int64, the forward's flat position of each bin's maximum in its
            ``H x W`` plane (-1: empty bin); a position outside its bin is not read.
        spatial_scale: as in ``roi_pool`` (the bins' geometry: which bins hold a pixel).
        pooled_height, pooled_width: ``PH``, ``PW``.
        batch_size, channels, height, width: the shape of ``roi_pool``'s input.

    Returns:
        ``[N, C, H, W]``, the gradient of ``roi_pool``'s input.

    Raises:
        ValueError: arguments the kernel does not take (the reason names them).

    Example::

        >>> grad = torch.ones(1, 1, 1, 1)
        >>> rois = torch.tensor([[0.0, 0.0, 0.0, 1.0, 1.0]])
        >>> roi_pool_backward(grad, rois, torch.tensor([[[[3]]]]), 1.0, 1, 1, 1, 1, 2, 2).flatten().tolist()
        [0.0, 0.0, 0.0, 1.0]
    """
    args = (grad, rois, argmax, spatial_scale, pooled_height, pooled_width, batch_size, channels, height, width)
    reason = roi_pool_backward_unsupported_reason(*args)
    if reason is not None:
        raise ValueError(f"{_OP}: {reason}")
    return _route(*args)


def _route(grad, rois, argmax, spatial_scale, pooled_height, pooled_width, batch_size, channels, height, width):
    return torch.ops.deepep_lightning.roi_pool_backward.default(
        grad, rois, argmax.to(torch.int32), float(spatial_scale), batch_size, channels, height, width
    )


def _fake_roi_pool_backward(grad, rois, argmax, spatial_scale, batch_size, channels, height, width):
    return grad.new_empty((batch_size, channels, height, width))


register_fakes({"deepep_lightning::roi_pool_backward": _fake_roi_pool_backward})

if _torchvision_entry.torchvision_ops_available():
    register_route(Route("_roi_pool_backward", _route, roi_pool_backward_unsupported_reason, namespace="torchvision"))
