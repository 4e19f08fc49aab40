"""Deterministic backward of torchvision's ``roi_align``, routed at the dispatcher.

torchvision's CUDA ``_roi_align_backward`` adds into ``grad_input`` with float ``atomicAdd`` (run-to-run
different last bits) and refuses deterministic mode; its Python ``roi_align`` avoids the refusal by
switching, in deterministic mode on CUDA, to a pure-PyTorch path that holds ``[K, C, PH, PW, IY, IX]``
tensors (tens of GiB with adaptive sampling). Here:

* ``torch.ops.deepep_lightning.roi_align_backward`` (``extensions/csrc/roi_align_backward.cpp``,
  ``cuda/roi_align_backward.cu``) computes the same gradient with a channel-independent sparse map from
  samples to pixels, sorted by pixel and gathered in a fixed order: bitwise reproducible, no float
  atomics, entries of a few bytes per sample corner (not per channel);
* a :class:`~deepep_lightning.ops._routes.Route` on ``torchvision::_roi_align_backward`` serves
  torchvision's CUDA kernel with it while routing is on and deterministic mode is on (torchvision's own
  kernel otherwise), so every caller of ``torch.ops.torchvision.roi_align`` is covered: ``RoIAlign``,
  ``MultiScaleRoIAlign``, the R-CNN heads, ``torch.compile``, CUDA graphs (fixed ``sampling_ratio``);
* while that route is installed, torchvision's Python ``roi_align`` takes the dispatcher path in every
  mode (:mod:`deepep_lightning.ops._torchvision_entry`).

Covered: float16/bfloat16/float32/float64, every ``sampling_ratio`` (adaptive ``<= 0`` reads its
sample count on the host, so it is left to torchvision inside CUDA-graph capture), ``aligned`` both
ways, empty RoI lists, non-contiguous gradients. Without torchvision nothing is registered.
"""

import torch
from torch import Tensor

from deepep_lightning.ops import _torchvision_entry
from deepep_lightning.ops._guards import FLOAT_DTYPES, kernels_reason
from deepep_lightning.ops._routes import Route, register_route
from deepep_lightning.ops.extension_loader import on_extension_loaded

__all__ = ["roi_align_backward", "roi_align_backward_unsupported_reason"]

_OP = "roi_align_backward"
_INT32_LIMIT = 2**31 - 1


def roi_align_backward_unsupported_reason(
    grad: Tensor,
    rois: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    batch_size: int,
    channels: int,
    height: int,
    width: int,
    sampling_ratio: int,
    aligned: bool,
    *,
    gathered: bool = True,
) -> str | None:
    """Why :func:`roi_align_backward` leaves these arguments to torchvision, or ``None`` when it covers them.

    Metadata only (no tensor values, no host sync), so the route may ask it inside CUDA-graph capture.
    ``gathered=False``: the caller's kernel is not the gather (``ps_roi_align``'s tile gather), so it neither
    shares the gather's half-precision CUDA path nor reads a sample count on the host.
    """
    if not isinstance(grad, Tensor) or not isinstance(rois, Tensor):
        return "grad and rois must be torch.Tensor"
    if torch.overrides.has_torch_function_variadic(grad, rois):
        return "tensor subclasses with __torch_function__ are left to torchvision"
    if grad.dtype not in FLOAT_DTYPES or rois.dtype != grad.dtype:
        return f"dtype {grad.dtype} (rois {rois.dtype}) is not one of {list(FLOAT_DTYPES)} for both"
    if gathered and grad.is_cuda and grad.dtype in (torch.float16, torch.bfloat16):
        # The CUDA gather's half-precision path gives NaNs on the H200 (tests/ops/test_torchvision_ops_cuda.py);
        # float16/bfloat16 stay torchvision's: the Python roi_align entry keeps its pure-PyTorch path for them
        # (ops/_torchvision_entry.py), and a direct call of the backward op meets torchvision's refusal.
        # Autocast runs roi_align in float32, so mixed-precision training takes the covered path.
        return f"{grad.dtype} on CUDA is left to torchvision: only float32/float64 are covered there"
    sizes = (pooled_height, pooled_width, batch_size, channels, height, width, sampling_ratio)
    if not all(isinstance(size, int) and not isinstance(size, bool) for size in sizes):
        return f"sizes {sizes!r} must be ints"
    if not isinstance(spatial_scale, float | int) or not isinstance(aligned, bool):
        return f"spatial_scale {spatial_scale!r} must be a float and aligned {aligned!r} a bool"
    if pooled_height <= 0 or pooled_width <= 0 or min(batch_size, channels, height, width) < 0:
        return f"pooled sizes must be positive and batch_size, channels, height, width >= 0, got {sizes!r}"
    if grad.dim() != 4 or tuple(grad.shape[1:]) != (channels, pooled_height, pooled_width):
        return f"grad of shape {tuple(grad.shape)} is not [K, {channels}, {pooled_height}, {pooled_width}]"
    if rois.dim() != 2 or tuple(rois.shape) != (grad.shape[0], 5):
        return f"rois of shape {tuple(rois.shape)} is not [{grad.shape[0]}, 5]"
    if batch_size * height * width >= _INT32_LIMIT or grad.shape[0] * pooled_height * pooled_width >= _INT32_LIMIT:
        return "batch_size * height * width and K * PH * PW must be below 2^31 - 1 (int32 keys)"
    if grad.device != rois.device:
        return f"grad and rois are on different devices ({grad.device}, {rois.device})"
    if gathered and sampling_ratio <= 0 and grad.is_cuda and torch.cuda.is_current_stream_capturing():
        return "adaptive sampling (sampling_ratio <= 0) reads its sample count on the host, which capture forbids"
    return kernels_reason(grad)


def roi_align_backward(
    grad: Tensor,
    rois: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    batch_size: int,
    channels: int,
    height: int,
    width: int,
    sampling_ratio: int,
    aligned: bool,
) -> Tensor:
    """``torchvision::_roi_align_backward`` (same arguments, same result to rounding), deterministic.

    Args:
        grad: ``[K, C, PH, PW]``, the gradient of ``roi_align``'s output.
        rois: ``[K, 5]`` boxes ``(batch index, x1, y1, x2, y2)``, ``grad``'s dtype and device.
        spatial_scale: box coordinates times ``spatial_scale`` are feature-map coordinates.
        pooled_height, pooled_width: ``PH``, ``PW``.
        batch_size, channels, height, width: the shape of ``roi_align``'s input.
        sampling_ratio: samples per bin along each axis; ``<= 0`` adapts to the box (``ceil(size / PH)``).
        aligned: shift the boxes by -0.5 pixel (torchvision's ``aligned=True``).

    Returns:
        ``[N, C, H, W]``, the gradient of ``roi_align``'s input.

    Raises:
        ValueError: arguments the kernel does not take (the reason names them).

    Example::

        >>> grad = torch.ones(1, 2, 3, 3)
        >>> rois = torch.tensor([[0.0, 1.0, 1.0, 6.0, 6.0]])
        >>> roi_align_backward(grad, rois, 1.0, 3, 3, 1, 2, 8, 8, 2, False).shape
        torch.Size([1, 2, 8, 8])
    """
    args = (grad, rois, spatial_scale, pooled_height, pooled_width, batch_size, channels, height, width)
    reason = roi_align_backward_unsupported_reason(*args, sampling_ratio, aligned)
    if reason is not None:
        raise ValueError(f"{_OP}: {reason}")
    return torch.ops.deepep_lightning.roi_align_backward.default(
        *args[:2], float(spatial_scale), *args[3:], sampling_ratio, aligned
    )


def _fake_backward(grad, rois, spatial_scale, pooled_height, pooled_width, batch_size, channels, height, width, *_):
    torch._check(grad.dim() == 4, lambda: f"{_OP}: grad must be 4-D [K, C, PH, PW], got {tuple(grad.shape)}")
    return grad.new_empty((batch_size, channels, height, width))


def _register_fake() -> None:
    torch.library.register_fake(f"deepep_lightning::{_OP}")(_fake_backward)


on_extension_loaded(_register_fake)


def _route_covers(grad: Tensor, rois: Tensor, spatial_scale: float, *rest) -> str | None:
    return roi_align_backward_unsupported_reason(grad, rois, spatial_scale, *rest)


def _route(grad: Tensor, rois: Tensor, spatial_scale: float, *rest) -> Tensor:
    return torch.ops.deepep_lightning.roi_align_backward.default(grad, rois, float(spatial_scale), *rest)


if _torchvision_entry.torchvision_ops_available():
    register_route(
        Route(
            "_roi_align_backward",
            _route,
            _route_covers,
            namespace="torchvision",
            on_install=_torchvision_entry.use_dispatcher_roi_align,
        )
    )
