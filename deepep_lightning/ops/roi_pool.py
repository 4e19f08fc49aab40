"""Deterministic backward of torchvision's ``roi_pool``, routed at the dispatcher.

torchvision's CUDA ``_roi_pool_backward`` adds each bin's gradient into ``grad_input`` at the bin's
argmax with float ``atomicAdd`` and refuses deterministic mode (``roi_pool_backward_kernel does not have a
deterministic implementation``). ``roi_pool`` is max pooling, so the target pixel of a bin depends on the
channel (the forward's per-channel ``argmax``): the backward is a scatter-add of ``grad[k, c, ph, pw]``
into plane ``(batch index of k) * C + c`` at position ``argmax[k, c, ph, pw]``. Bins without a pixel
(``argmax == -1``) add nothing.

float16, bfloat16 and float32 go through ``torch.ops.deepep_lightning.roi_pool_backward``
(``extensions/csrc/roi_fixed_point.cpp``): the atomic kernel's one pass, with every term added as a 64-bit
fixed-point integer, so the sums do not depend on the order of the atomics (``fixed_point_sum.h``). float64,
whose precision a 64-bit fixed-point sum cannot hold, goes through
:func:`deepep_lightning.ops.scatter.segment_scatter_add` (stable sort of the targets, each element summed
once in a fixed order, in double).

Covered: float16/bfloat16/float32/float64, empty RoI lists, non-contiguous gradients, any device of the
extension. Without torchvision nothing is registered.
"""

import torch
from torch import Tensor

from deepep_lightning.ops import _torchvision_entry
from deepep_lightning.ops._guards import FLOAT_DTYPES, kernels_reason, register_fakes
from deepep_lightning.ops._routes import Route, register_route
from deepep_lightning.ops.scatter import segment_scatter_add

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
    if grad.dim() != 4 or tuple(grad.shape[1:]) != (channels, pooled_height, pooled_width):
        return f"grad of shape {tuple(grad.shape)} is not [K, {channels}, {pooled_height}, {pooled_width}]"
    if argmax.shape != grad.shape:
        return f"argmax of shape {tuple(argmax.shape)} is not grad's {tuple(grad.shape)}"
    if rois.dim() != 2 or tuple(rois.shape) != (grad.shape[0], 5):
        return f"rois of shape {tuple(rois.shape)} is not [{grad.shape[0]}, 5]"
    if batch_size * channels * height * width > _INT32_LIMIT or grad.numel() > _INT32_LIMIT:
        return "batch_size * channels * height * width and grad.numel() must be below 2^31 - 1 (32-bit keys)"
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
            ``H x W`` plane (-1: empty bin).
        spatial_scale: unused by the backward (the positions are in ``argmax``); kept for the schema.
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
    return _scatter(*args)


def _scatter(grad, rois, argmax, spatial_scale, pooled_height, pooled_width, batch_size, channels, height, width):
    if grad.dtype != torch.float64:
        return torch.ops.deepep_lightning.roi_pool_backward.default(
            grad, rois, argmax.to(torch.int32), batch_size, channels, height, width
        )
    plane_size = height * width
    # int32 keys: the plane index times H * W fits (checked), and they halve the sort's memory
    planes = rois[:, 0].to(torch.int32)[:, None] * channels + torch.arange(
        channels, device=grad.device, dtype=torch.int32
    )  # [K, C]
    inside = argmax >= 0  # [K, C, PH, PW]
    target = torch.where(inside, planes[:, :, None, None] * plane_size + argmax.to(torch.int32), 0)
    values = torch.where(inside, grad, 0)
    out = segment_scatter_add(values.reshape(-1), target.reshape(-1), batch_size * channels * plane_size)
    return out.view(batch_size, channels, height, width)


def _fake_roi_pool_backward(grad, rois, argmax, batch_size, channels, height, width):
    return grad.new_empty((batch_size, channels, height, width))


register_fakes({"deepep_lightning::roi_pool_backward": _fake_roi_pool_backward})

if _torchvision_entry.torchvision_ops_available():
    register_route(Route("_roi_pool_backward", _scatter, roi_pool_backward_unsupported_reason, namespace="torchvision"))
