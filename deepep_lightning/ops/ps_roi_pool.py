"""Deterministic backward of torchvision's ``ps_roi_pool`` (position-sensitive RoI pooling), routed at the dispatcher.

torchvision's CUDA ``_ps_roi_pool_backward`` adds ``grad / bin_area`` into every pixel of each bin's
rectangle with float ``atomicAdd`` and refuses deterministic mode. The rectangles depend on the RoI
alone, and bin ``b`` of output channel ``c`` feeds input channel ``c * PH * PW + b`` (the forward's
``channel_mapping`` always holds that).

float16, bfloat16 and float32 go through ``torch.ops.deepep_lightning.ps_roi_pool_backward``
(``extensions/csrc/roi_fixed_point.cpp``): torchvision's kernel, one thread per bin computing its rectangle
with torchvision's formulas in the gradient's type, with every term added as a 64-bit fixed-point integer,
so the sums do not depend on the order of the atomics (``fixed_point_sum.h``); no host synchronisation, so
it runs inside CUDA-graph capture. float64, whose precision a 64-bit fixed-point sum cannot hold, is the
sparse gather of ``extensions/csrc/roi_csr_gather.h`` with one entry per (bin, pixel of its rectangle): the
entries are built here with tensor ops (torchvision's formulas: ``roundf`` of the scaled box, bins
``[floor(ph * bin_h), ceil((ph + 1) * bin_h))`` offset and clipped to ``[0, H]``), padded to the largest
rectangle, and ``torch.ops.deepep_lightning.roi_csr_gather`` sorts them by pixel and sums every
``grad_input`` element in a fixed order. Its padding size is read on the host (one sync), so inside
CUDA-graph capture float64 is left to torchvision.

Covered: float16/bfloat16/float32/float64, empty RoI lists, non-contiguous gradients. Without torchvision
nothing is registered.
"""

import torch
from torch import Tensor

from deepep_lightning.ops import _torchvision_entry
from deepep_lightning.ops._guards import FLOAT_DTYPES, kernels_reason, register_fakes
from deepep_lightning.ops._routes import Route, register_route

__all__ = ["ps_roi_pool_backward", "ps_roi_pool_backward_unsupported_reason"]

_OP = "ps_roi_pool_backward"
_INT32_LIMIT = 2**31 - 1


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
    if batch_size * channels * height * width >= _INT32_LIMIT or grad.numel() >= _INT32_LIMIT:
        return "batch_size * channels * height * width and grad.numel() must be below 2^31 - 1 (int32 keys)"
    if not grad.device == rois.device == channel_mapping.device:
        return "grad, rois and channel_mapping are on different devices"
    if grad.dtype == torch.float64 and grad.is_cuda and torch.cuda.is_current_stream_capturing():
        return "float64's entry padding is read on the host, which CUDA-graph capture forbids"
    return kernels_reason(grad)


def _round_half_away(values: Tensor) -> Tensor:
    """C's ``roundf``: halves away from zero (``torch.round`` rounds them to even)."""
    return torch.sign(values) * torch.floor(values.abs() + 0.5)


def _bin_edges(start: Tensor, end: Tensor, pooled: int, size: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """torchvision's ``[start, end)`` of every bin along one axis, ``[K, pooled]`` each."""
    extent = (end - start).clamp(min=1).to(dtype)[:, None]  # [K, 1]
    # Divided by a tensor: CUDA divides by a Python scalar as a product with its reciprocal, which misses C's
    # quotient by an ulp (7 * float(1/3) = 2.3333335, not 2.3333333, so the last bin ends at ceil(7.0000005) = 8
    # instead of 7) and moves a bin edge by a whole pixel.
    bin_size = extent / torch.full_like(extent, pooled)
    index = torch.arange(pooled, device=start.device, dtype=dtype)[None, :]
    low = torch.floor(index * bin_size).long() + start[:, None]
    high = torch.ceil((index + 1) * bin_size).long() + start[:, None]
    return low.clamp(0, size), high.clamp(0, size)


def _gather(
    grad, rois, channel_mapping, spatial_scale, pooled_height, pooled_width, batch_size, channels, height, width
):
    if grad.dtype != torch.float64:
        return torch.ops.deepep_lightning.ps_roi_pool_backward.default(
            grad, rois, spatial_scale, pooled_height, pooled_width, batch_size, channels, height, width
        )
    bins = pooled_height * pooled_width
    channels_out = channels // bins
    if rois.shape[0] == 0:
        return grad.new_zeros((batch_size, channels, height, width))
    corners = _round_half_away(rois[:, 1:] * spatial_scale).long()  # [K, 4]: x1, y1, x2, y2
    row_low, row_high = _bin_edges(corners[:, 1], corners[:, 3], pooled_height, height, rois.dtype)  # [K, PH]
    col_low, col_high = _bin_edges(corners[:, 0], corners[:, 2], pooled_width, width, rois.dtype)  # [K, PW]
    rows, cols = (row_high - row_low).clamp(min=0), (col_high - col_low).clamp(min=0)
    area = rows[:, :, None] * cols[:, None, :]  # [K, PH, PW]; 0: an empty bin, no entries
    most_rows, most_cols = int(rows.max()), int(cols.max())  # host sync: the padding of the entries
    dy = torch.arange(most_rows, device=grad.device)
    dx = torch.arange(most_cols, device=grad.device)
    y = row_low[:, :, None] + dy  # [K, PH, MY]
    x = col_low[:, :, None] + dx  # [K, PW, MX]
    inside = (dy < rows[:, :, None])[:, :, None, :, None] & (dx < cols[:, :, None])[:, None, :, None, :]
    batch = rois[:, 0].long()[:, None, None, None, None]
    bin_index = torch.arange(bins, device=grad.device).view(1, pooled_height, pooled_width, 1, 1)
    keys = ((batch * bins + bin_index) * height + y[:, :, None, :, None]) * width + x[:, None, :, None, :]
    destinations = batch_size * bins * height * width
    keys = torch.where(inside, keys, destinations).to(torch.int32)  # [K, PH, PW, MY, MX]
    roi_index = torch.arange(rois.shape[0], device=grad.device).view(-1, 1, 1, 1, 1)
    sources = (roi_index * bins + bin_index).to(torch.int32).expand_as(keys)
    weight_dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
    weights = (1.0 / area.clamp(min=1).to(weight_dtype))[:, :, :, None, None].expand(keys.shape)
    return torch.ops.deepep_lightning.roi_csr_gather.default(
        keys.reshape(-1),
        sources.reshape(-1),
        weights.reshape(-1),
        grad,
        batch_size,
        bins,
        channels_out,
        height,
        width,
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
    return _gather(*args)


def _fake_gather(keys, sources, weights, grad, batch, planes, channels, height, width):
    torch._check(grad.dim() == 4, lambda: f"roi_csr_gather: grad must be 4-D, got {tuple(grad.shape)}")
    return grad.new_empty((batch, channels * planes, height, width))


def _fake_ps_roi_pool_backward(grad, rois, spatial_scale, pooled_height, pooled_width, batch, channels, height, width):
    return grad.new_empty((batch, channels, height, width))


register_fakes(
    {
        "deepep_lightning::roi_csr_gather": _fake_gather,
        "deepep_lightning::ps_roi_pool_backward": _fake_ps_roi_pool_backward,
    }
)

if _torchvision_entry.torchvision_ops_available():
    register_route(
        Route("_ps_roi_pool_backward", _gather, ps_roi_pool_backward_unsupported_reason, namespace="torchvision")
    )
