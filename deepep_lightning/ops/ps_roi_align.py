"""Deterministic backward of torchvision's ``ps_roi_align`` (position-sensitive RoI Align), routed at the dispatcher.

torchvision's CUDA ``_ps_roi_align_backward`` adds into ``grad_input`` with float ``atomicAdd`` and refuses
deterministic mode. Its bins are sampled as ``roi_align``'s with ``aligned=True`` (the kernels share the
formulas), and bin ``b`` of output channel ``c`` reads input channel ``c * PH * PW + b`` (the forward's
``channel_mapping`` always holds that). ``torch.ops.deepep_lightning.ps_roi_align_backward``
(``extensions/csrc/roi_tiles.h``) writes every ``grad_input`` element once: a tile of pixels of one bin's
plane lists, in RoI order, the bins whose samples' bilinear corners can reach it, and each pixel sums
``grad * w / count`` over the corners that land on it in torchvision's CPU order (RoI, sample, corner), whose
float32 and float64 bits it gives. No atomics, no host synchronisation (CUDA-graph capturable), the same bits
on the CPU and CUDA.

Covered: float16/bfloat16/float32/float64 (16-bit terms summed in float, rounded once), every
``sampling_ratio``, empty RoI lists, non-contiguous gradients. Without torchvision nothing is registered.
"""

import torch
from torch import Tensor

from deepep_lightning.ops import _torchvision_entry
from deepep_lightning.ops._routes import Route, register_route
from deepep_lightning.ops.extension_loader import on_extension_loaded
from deepep_lightning.ops.roi_align import roi_align_backward_unsupported_reason

__all__ = ["ps_roi_align_backward", "ps_roi_align_backward_unsupported_reason"]

_OP = "ps_roi_align_backward"


def ps_roi_align_backward_unsupported_reason(
    grad: Tensor,
    rois: Tensor,
    channel_mapping: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    sampling_ratio: int,
    batch_size: int,
    channels: int,
    height: int,
    width: int,
) -> str | None:
    """Why :func:`ps_roi_align_backward` leaves these arguments to torchvision, or ``None``. Metadata only."""
    if not isinstance(channel_mapping, Tensor) or channel_mapping.dtype not in (torch.int32, torch.int64):
        return "channel_mapping must be an int32/int64 torch.Tensor"
    if not all(isinstance(size, int) and not isinstance(size, bool) for size in (pooled_height, pooled_width)):
        return f"pooled sizes {(pooled_height, pooled_width)!r} must be ints"
    bins = pooled_height * pooled_width
    if bins <= 0 or not isinstance(channels, int) or channels % bins != 0:
        return f"channels {channels!r} is not a multiple of pooled_height * pooled_width = {bins}"
    if isinstance(grad, Tensor) and tuple(channel_mapping.shape) != tuple(grad.shape):
        return f"channel_mapping of shape {tuple(channel_mapping.shape)} is not grad's {tuple(grad.shape)}"
    reason = roi_align_backward_unsupported_reason(
        grad,
        rois,
        spatial_scale,
        pooled_height,
        pooled_width,
        batch_size,
        channels // bins,
        height,
        width,
        sampling_ratio,
        True,
        gathered=False,
    )
    return reason


def ps_roi_align_backward(
    grad: Tensor,
    rois: Tensor,
    channel_mapping: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    sampling_ratio: int,
    batch_size: int,
    channels: int,
    height: int,
    width: int,
) -> Tensor:
    """``torchvision::_ps_roi_align_backward`` (same arguments, same result to rounding), deterministic.

    Args:
        grad: ``[K, C / (PH * PW), PH, PW]``, the gradient of ``ps_roi_align``'s output.
        rois: ``[K, 5]`` boxes ``(batch index, x1, y1, x2, y2)``, ``grad``'s dtype and device.
        channel_mapping: the forward's ``[K, C / (PH * PW), PH, PW]`` input channels (not read: it always
            holds ``c * PH * PW + bin``).
        spatial_scale, pooled_height, pooled_width, sampling_ratio: as in ``ps_roi_align``.
        batch_size, channels, height, width: the shape ``[N, C, H, W]`` of ``ps_roi_align``'s input.

    Returns:
        ``[N, C, H, W]``, the gradient of ``ps_roi_align``'s input.

    Raises:
        ValueError: arguments the kernel does not take (the reason names them).

    Example::

        >>> grad = torch.ones(1, 1, 2, 2)
        >>> rois = torch.tensor([[0.0, 0.0, 0.0, 4.0, 4.0]])
        >>> mapping = torch.arange(4, dtype=torch.int32).view(1, 1, 2, 2)
        >>> ps_roi_align_backward(grad, rois, mapping, 1.0, 2, 2, 2, 1, 4, 5, 5).shape
        torch.Size([1, 4, 5, 5])
    """
    geometry = (spatial_scale, pooled_height, pooled_width, sampling_ratio, batch_size, channels, height, width)
    reason = ps_roi_align_backward_unsupported_reason(grad, rois, channel_mapping, *geometry)
    if reason is not None:
        raise ValueError(f"{_OP}: {reason}")
    return _route(grad, rois, channel_mapping, *geometry)


def _fake_backward(grad, rois, channel_mapping, spatial_scale, pooled_height, pooled_width, sampling_ratio, *shape):
    torch._check(grad.dim() == 4, lambda: f"{_OP}: grad must be 4-D [K, C_out, PH, PW], got {tuple(grad.shape)}")
    return grad.new_empty(tuple(shape))


def _register_fake() -> None:
    torch.library.register_fake(f"deepep_lightning::{_OP}")(_fake_backward)


on_extension_loaded(_register_fake)


def _route(grad: Tensor, rois: Tensor, channel_mapping: Tensor, spatial_scale: float, *rest) -> Tensor:
    return torch.ops.deepep_lightning.ps_roi_align_backward.default(
        grad, rois, channel_mapping, float(spatial_scale), *rest
    )


if _torchvision_entry.torchvision_ops_available():
    register_route(
        Route("_ps_roi_align_backward", _route, ps_roi_align_backward_unsupported_reason, namespace="torchvision")
    )
