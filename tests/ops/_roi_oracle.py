"""Pure-PyTorch float64 oracles of torchvision's RoI backwards, shared by the CPU and GPU tests.

The ``roi_align`` oracle follows torchvision's CUDA kernel (``roi_align_backward_kernel_impl`` and
``bilinear_interpolate_gradient``) RoI by RoI, with tensors per RoI, and adds with ``index_add_`` on the
CPU (a sequential loop): slow, exact in float64, independent of the kernel under test. ``roi_pool``'s is the
definition of a max pooling's backward (each bin's gradient at its argmax); ``ps_roi_pool``'s adds each bin's
gradient over its area to every pixel of the bin's rectangle, with torchvision's bin formulas.
"""

import math

import torch
from torch import Tensor


def _axis_corners(coordinate: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """torchvision's clamping along one axis: (low, high, weight of low, weight of high, inside)."""
    inside = (coordinate >= -1.0) & (coordinate <= size)
    coordinate = coordinate.clamp(min=0.0)
    low = coordinate.floor().long()
    at_edge = low >= size - 1
    low = torch.where(at_edge, torch.full_like(low, size - 1), low)
    high = torch.where(at_edge, low, low + 1)
    coordinate = torch.where(at_edge, low.double(), coordinate)
    fraction = coordinate - low.double()
    return low, high, 1.0 - fraction, fraction, inside


def roi_align_backward_oracle(
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
    """``[N, C, H, W]`` float64 gradient of ``roi_align``'s input."""
    grad = grad.detach().double().cpu()
    rois = rois.detach().double().cpu()
    out = torch.zeros(batch_size, channels, height * width, dtype=torch.float64)
    offset = 0.5 if aligned else 0.0
    for k in range(rois.shape[0]):
        batch = int(rois[k, 0])
        if not 0 <= batch < batch_size:  # a box of no image of the batch adds nothing
            continue
        start_w, start_h, end_w, end_h = (float(v) * spatial_scale - offset for v in rois[k, 1:])
        roi_w, roi_h = end_w - start_w, end_h - start_h
        if not aligned:
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        bin_h, bin_w = roi_h / pooled_height, roi_w / pooled_width
        grid_h = sampling_ratio if sampling_ratio > 0 else max(math.ceil(roi_h / pooled_height), 0)
        grid_w = sampling_ratio if sampling_ratio > 0 else max(math.ceil(roi_w / pooled_width), 0)
        if grid_h == 0 or grid_w == 0:
            continue
        count = grid_h * grid_w
        ph = torch.arange(pooled_height, dtype=torch.float64)[:, None]
        pw = torch.arange(pooled_width, dtype=torch.float64)[:, None]
        y = start_h + ph * bin_h + (torch.arange(grid_h, dtype=torch.float64) + 0.5) * bin_h / grid_h  # [PH, IY]
        x = start_w + pw * bin_w + (torch.arange(grid_w, dtype=torch.float64) + 0.5) * bin_w / grid_w  # [PW, IX]
        y_low, y_high, hy, ly, y_in = _axis_corners(y, height)
        x_low, x_high, hx, lx, x_in = _axis_corners(x, width)

        def outer(a: Tensor, b: Tensor) -> Tensor:  # [PH, IY] x [PW, IX] -> [PH, PW, IY, IX]
            return a[:, None, :, None] * b[None, :, None, :]

        inside = outer(y_in.double(), x_in.double())
        terms = grad[k][:, :, :, None, None] / count  # [C, PH, PW, 1, 1]
        for rows, row_weight in ((y_low, hy), (y_high, ly)):
            for cols, col_weight in ((x_low, hx), (x_high, lx)):
                weight = outer(row_weight, col_weight) * inside  # [PH, PW, IY, IX]
                pixel = rows[:, None, :, None] * width + cols[None, :, None, :]
                contribution = (terms * weight).reshape(channels, -1)
                out[batch].index_add_(1, pixel.expand_as(weight).reshape(-1), contribution)
    return out.view(batch_size, channels, height, width)


def ps_roi_align_backward_oracle(
    grad: Tensor,
    rois: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    sampling_ratio: int,
    batch_size: int,
    channels: int,
    height: int,
    width: int,
) -> Tensor:
    """``[N, C, H, W]`` float64 gradient of ``ps_roi_align``'s input: bin ``b`` of output channel ``c`` is
    ``roi_align``'s (``aligned=True``) restricted to that bin, in input channel ``c * PH * PW + b``."""
    bins = pooled_height * pooled_width
    channels_out = channels // bins
    out = torch.zeros(batch_size, channels_out, bins, height, width, dtype=torch.float64)
    for b in range(bins):
        only_b = torch.zeros(grad.shape, dtype=torch.float64)
        only_b.view(grad.shape[0], channels_out, bins)[:, :, b] = (
            grad.detach().double().cpu().reshape(grad.shape[0], channels_out, bins)[:, :, b]
        )
        out[:, :, b] = roi_align_backward_oracle(
            only_b,
            rois,
            spatial_scale,
            pooled_height,
            pooled_width,
            batch_size,
            channels_out,
            height,
            width,
            sampling_ratio,
            True,
        )
    return out.view(batch_size, channels, height, width)


def roi_pool_backward_oracle(
    grad: Tensor, rois: Tensor, argmax: Tensor, batch_size: int, channels: int, height: int, width: int
) -> Tensor:
    """``[N, C, H, W]`` float64 gradient of ``roi_pool``'s input: ``grad[k, c, ph, pw]`` at ``argmax[k, c, ph, pw]``
    of plane (batch index of RoI ``k``, ``c``); empty bins (-1) and RoIs of no image of the batch add nothing."""
    out = torch.zeros(batch_size * channels * height * width, dtype=torch.float64)
    grad, argmax = grad.detach().double().cpu(), argmax.cpu().long()
    for k, image in enumerate(rois[:, 0].cpu().tolist()):
        n = int(image)
        if not 0 <= n < batch_size:
            continue
        planes = (n * channels + torch.arange(channels))[:, None, None] * (height * width)
        kept = argmax[k] >= 0
        out.index_add_(0, (planes + argmax[k])[kept], grad[k][kept])
    return out.view(batch_size, channels, height, width)


def ps_roi_pool_backward_oracle(
    grad: Tensor,
    rois: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    batch_size: int,
    channels: int,
    height: int,
    width: int,
) -> Tensor:
    """``[N, C, H, W]`` float64 gradient of ``ps_roi_pool``'s input: bin ``b`` of output channel ``c`` adds
    ``grad / area`` to every pixel of its rectangle in input channel ``c * PH * PW + b`` (torchvision's formulas:
    C's ``roundf`` of the scaled box in float32, extents at least 1, bins ``[floor(p * bin), ceil((p + 1) * bin))``
    offset and clipped to the map)."""
    bins = pooled_height * pooled_width
    out = torch.zeros(batch_size, channels, height, width, dtype=torch.float64)
    grad = grad.detach().double().cpu()

    def round_half_away(value: float) -> int:
        value = float(torch.tensor(value, dtype=torch.float32))  # roundf's argument is a float
        return int(math.copysign(math.floor(abs(value) + 0.5), value))

    for k, roi in enumerate(rois.detach().cpu().tolist()):
        n = int(roi[0])
        if not 0 <= n < batch_size:
            continue
        x1, y1, x2, y2 = (round_half_away(v * spatial_scale) for v in roi[1:])
        bin_h, bin_w = max(y2 - y1, 1) / pooled_height, max(x2 - x1, 1) / pooled_width
        for ph in range(pooled_height):
            h0 = min(max(math.floor(ph * bin_h) + y1, 0), height)
            h1 = min(max(math.ceil((ph + 1) * bin_h) + y1, 0), height)
            for pw in range(pooled_width):
                w0 = min(max(math.floor(pw * bin_w) + x1, 0), width)
                w1 = min(max(math.ceil((pw + 1) * bin_w) + x1, 0), width)
                if h1 <= h0 or w1 <= w0:
                    continue
                b = ph * pooled_width + pw
                values = grad[k, :, ph, pw] / ((h1 - h0) * (w1 - w0))  # [C_out]
                out[n, b::bins, h0:h1, w0:w1] += values[:, None, None]
    return out


def deform_conv2d_oracle(
    input: Tensor,
    weight: Tensor,
    offset: Tensor,
    mask: Tensor | None,
    stride: int,
    padding: int,
    dilation: int,
    offset_groups: int,
) -> Tensor:
    """torchvision's ``deform_conv2d`` forward (no bias, ``groups=1``) written with gathers, differentiable: its
    autograd gives the float64 input gradient. Bilinear sampling as torchvision's: zero outside
    ``(-1, H) x (-1, W)``, corners outside the map count as zero."""
    batch, channels, height, width = input.shape
    out_channels, _, kernel_h, kernel_w = weight.shape
    out_h, out_w = offset.shape[2:]
    per_group = channels // offset_groups
    columns = []  # per tap: [N, C, out_h, out_w]
    for k in range(kernel_h * kernel_w):
        ki, kj = divmod(k, kernel_w)
        base_y = (torch.arange(out_h, dtype=input.dtype) * stride - padding + ki * dilation)[:, None]
        base_x = (torch.arange(out_w, dtype=input.dtype) * stride - padding + kj * dilation)[None, :]
        sampled = []
        for g in range(offset_groups):
            y = base_y + offset[:, (g * kernel_h * kernel_w + k) * 2]  # [N, out_h, out_w]
            x = base_x + offset[:, (g * kernel_h * kernel_w + k) * 2 + 1]
            inside = (y > -1) & (y < height) & (x > -1) & (x < width)
            y0, x0 = y.floor(), x.floor()
            value = 0
            for yp, wy in ((y0, 1 - (y - y0)), (y0 + 1, y - y0)):
                for xp, wx in ((x0, 1 - (x - x0)), (x0 + 1, x - x0)):
                    valid = inside & (yp >= 0) & (yp < height) & (xp >= 0) & (xp < width)
                    flat = (yp.clamp(0, height - 1) * width + xp.clamp(0, width - 1)).long().flatten(1)  # [N, L]
                    group = input[:, g * per_group : (g + 1) * per_group].flatten(2)  # [N, C/G, H*W]
                    picked = group.gather(2, flat[:, None, :].expand(-1, per_group, -1)).view(
                        batch, per_group, out_h, out_w
                    )
                    value = value + picked * (wy * wx * valid)[:, None]
            if mask is not None:
                value = value * mask[:, g * kernel_h * kernel_w + k][:, None]
            sampled.append(value)
        columns.append(torch.cat(sampled, dim=1))
    stacked = torch.stack(columns, dim=2)  # [N, C, K, out_h, out_w]
    return torch.einsum("ncklm,ock->nolm", stacked, weight.flatten(2))
