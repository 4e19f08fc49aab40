"""The bound on the terms per pixel that sizes ps_roi_align's fixed-point quantum (extensions/csrc/roi_fixed_point.h).

The quantum is chosen so that a sum of at most 2^b terms cannot overflow, b from a bound on the terms one pixel of
one channel receives: 4 * K * 25 with adaptive sampling (a bin's samples are at least half a pixel apart once the
bin is a pixel wide, so at most 5 x 5 of them reach a pixel, with up to 4 corners there at the border) and
4 * K * ratio^2 with a fixed ratio. A bound that did not hold would let a sum wrap: this counts, with
torchvision's geometry in float32, the corners every pixel receives from one RoI's bin, for boxes from a tenth of
a pixel to past the map, at its borders and inside.
"""

import math

import pytest
import torch

PER_ROI_BOUND = {-1: 4 * 25, 0: 4 * 25, 1: 4, 2: 4 * 4, 3: 4 * 9}


def _corner_counts(box, bin_index, pooled, sampling_ratio, height, width):
    """Corners each pixel receives from bin ``bin_index`` of one aligned box (torchvision's formulas, float32)."""
    f = torch.float32
    x1, y1, x2, y2 = (torch.tensor(v, dtype=f) - torch.tensor(0.5, dtype=f) for v in box)
    bin_h = (y2 - y1) / torch.tensor(float(pooled), dtype=f)
    bin_w = (x2 - x1) / torch.tensor(float(pooled), dtype=f)
    grid_h = sampling_ratio if sampling_ratio > 0 else max(math.ceil(bin_h.item()), 0)
    grid_w = sampling_ratio if sampling_ratio > 0 else max(math.ceil(bin_w.item()), 0)
    ph, pw = divmod(bin_index, pooled)
    iy = torch.arange(grid_h, dtype=f)
    ix = torch.arange(grid_w, dtype=f)
    y = y1 + ph * bin_h + (iy + 0.5) * bin_h / grid_h
    x = x1 + pw * bin_w + (ix + 0.5) * bin_w / grid_w
    y, x = torch.meshgrid(y, x, indexing="ij")
    y, x = y.reshape(-1), x.reshape(-1)
    inside = (y >= -1) & (y <= height) & (x >= -1) & (x <= width)
    y, x = y[inside].clamp(min=0), x[inside].clamp(min=0)
    y_low, x_low = y.long(), x.long()
    y_low, x_low = y_low.clamp(max=height - 1), x_low.clamp(max=width - 1)
    y_high = torch.where(y_low >= height - 1, y_low, y_low + 1)
    x_high = torch.where(x_low >= width - 1, x_low, x_low + 1)
    pixels = torch.cat([y_low * width + x_low, y_low * width + x_high, y_high * width + x_low, y_high * width + x_high])
    return torch.bincount(pixels, minlength=height * width)


@pytest.mark.parametrize("sampling_ratio", [-1, 1, 2, 3])
def test_no_pixel_receives_more_corners_from_a_bin_than_the_bound(sampling_ratio):
    height, width, pooled = 13, 17, 3
    generator = torch.Generator().manual_seed(0)
    sizes = [0.1, 0.7, 1.0, 1.5, 2.9, 3.1, 9.0, 100.0]  # bin sizes in pixels
    boxes = []
    for size_h in sizes:
        for size_w in sizes:
            for corner in ([-2.0, -2.0], [width - 1.0, height - 1.0], [5.3, 4.7]):
                boxes.append((corner[0], corner[1], corner[0] + size_w * pooled, corner[1] + size_h * pooled))
    for _ in range(40):
        xy = torch.rand(2, generator=generator) * torch.tensor([width + 4.0, height + 4.0]) - 2
        wh = torch.rand(2, generator=generator) * 40 + 0.05
        boxes.append((xy[0].item(), xy[1].item(), (xy[0] + wh[0]).item(), (xy[1] + wh[1]).item()))
    most = 0
    for box in boxes:
        for bin_index in range(pooled * pooled):
            most = max(most, int(_corner_counts(box, bin_index, pooled, sampling_ratio, height, width).max()))
    assert most <= PER_ROI_BOUND[sampling_ratio], (most, PER_ROI_BOUND[sampling_ratio])
    # the count sees stacked corners: with a fixed ratio the bound is reached (the border clamps put all 4
    # corners of every sample of a tiny bin on one pixel); adaptive sampling stays within a quarter of it
    assert most == PER_ROI_BOUND[sampling_ratio] if sampling_ratio > 0 else 16 <= most <= 25
