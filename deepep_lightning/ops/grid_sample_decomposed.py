"""Deterministic ``grid_sample`` backwards composed from PyTorch ops: trilinear 3-D, nearest 2-D and 3-D,
bicubic 2-D.

PyTorch's CUDA ``grid_sampler_3d_backward`` (``F.grid_sample`` on a 5-D input) and the nearest and
bicubic modes of ``grid_sampler_2d_backward`` scatter every output's corner contributions into the input
gradient with float ``atomicAdd`` and are refused under ``torch.use_deterministic_algorithms(True)``
(``grid_sampler_3d_backward_cuda does not have a deterministic implementation``). The bilinear 2-D case
has a CUDA kernel of its own (:mod:`deepep_lightning.ops.grid_sample`), whose route hands the nearest
and bicubic modes to :func:`nearest_backward` and :func:`bicubic_backward` here. They are computed
from PyTorch ops:

* the source coordinates and their derivatives follow PyTorch's ``GridSampler.cuh`` (unnormalize, then
  clip for ``border``, reflect and clip for ``reflection``, each with its gradient multiplier);
* ``grad_input`` is one ``index_put_(accumulate=True)`` of the 8 weighted corners (trilinear), the 16
  weighted taps (bicubic: the padding applied per tap, as PyTorch's ``add_value_bounded``) or the
  nearest pixel (nearest: ``round`` half to even, as PyTorch's ``nearbyint``) of every output into
  the flat input gradient: in deterministic mode PyTorch sorts the indices and sums each input's
  contributions in a fixed order, so the result is bitwise reproducible;
* ``grad_grid`` is a per-point gather (no accumulation across points), reduced over channels; zero
  for nearest, as PyTorch's.

* covered: ``interpolation_mode`` 0 (bilinear, 3-D), 1 (nearest, 2-D via the 2-D route, and 3-D) and
  2 (bicubic, 2-D via the 2-D route), every ``padding_mode``, both ``align_corners``,
  float16/bfloat16/float32/float64 (coordinates in float32 or float64), input and grid of matching rank
  and batch, non-empty spatial sizes. Extra memory: one ``[N, C, points]`` value and index tensor per
  corner or tap (8 trilinear, 16 bicubic, 1 nearest).
* everything else (bicubic 3-D, which PyTorch refuses to sample, shape errors) goes to PyTorch's kernel:
  its result and its errors.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from deepep_lightning.ops._guards import FLOAT_DTYPES
from deepep_lightning.ops._routes import Route, register_route

__all__ = [
    "bicubic_backward",
    "decomposed_backward_unsupported_reason",
    "grid_sampler_3d_backward_unsupported_reason",
    "nearest_backward",
]

_DTYPES = FLOAT_DTYPES
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2
_BILINEAR, _NEAREST = 0, 1


def decomposed_backward_unsupported_reason(
    grad_output: Tensor,
    input: Tensor,
    grid: Tensor,
    padding_mode: int,
    spatial: int,
) -> str | None:
    """Why the decomposed backward of ``spatial`` (2 or 3) dims would hand these to PyTorch, or ``None``."""
    if not all(isinstance(t, Tensor) for t in (grad_output, input, grid)):
        return "grad_output, input and grid must be torch.Tensor"
    if padding_mode not in (_ZEROS, _BORDER, _REFLECTION):
        return f"padding_mode={padding_mode!r} is left to PyTorch to validate"
    rank = spatial + 2
    if input.dim() != rank or grid.dim() != rank or grid.shape[-1] != spatial or grid.shape[0] != input.shape[0]:
        return f"input {tuple(input.shape)} / grid {tuple(grid.shape)} are left to PyTorch to validate"
    if min(input.shape[2:]) <= 0:
        return "empty spatial sizes are left to PyTorch"
    expected = (input.shape[0], input.shape[1], *grid.shape[1:-1])
    if tuple(grad_output.shape) != expected:
        return f"grad_output {tuple(grad_output.shape)} does not match {expected}"
    if input.dtype not in _DTYPES or grid.dtype != input.dtype or grad_output.dtype != input.dtype:
        return f"dtypes {input.dtype} / {grid.dtype} / {grad_output.dtype} are not one of {list(_DTYPES)}"
    if not (input.device == grid.device == grad_output.device) or input.device.type not in ("cpu", "cuda"):
        return f"devices {input.device} / {grid.device} / {grad_output.device} are not covered"
    return None


def grid_sampler_3d_backward_unsupported_reason(
    grad_output: Tensor,
    input: Tensor,
    grid: Tensor,
    interpolation_mode: int,
    padding_mode: int,
    align_corners: bool,
    output_mask: Sequence[bool],
) -> str | None:
    """Why the deterministic 3-D backward would hand these arguments to PyTorch, or ``None``."""
    if interpolation_mode not in (_BILINEAR, _NEAREST):
        return f"interpolation_mode={interpolation_mode!r} is not covered, only 0 (bilinear) and 1 (nearest)"
    return decomposed_backward_unsupported_reason(grad_output, input, grid, padding_mode, 3)


def _clip_set_grad(coordinate: Tensor, size: int) -> tuple[Tensor, Tensor]:
    # PyTorch's clip_coordinates_set_grad: gradient 0 where clipped (at or beyond either edge).
    inside = (coordinate > 0) & (coordinate < size - 1)
    return coordinate.clamp(0, size - 1), inside.to(coordinate.dtype)


def _reflect_set_grad(coordinate: Tensor, twice_low: int, twice_high: int) -> tuple[Tensor, Tensor]:
    # PyTorch's reflect_coordinates_set_grad.
    if twice_low == twice_high:
        return torch.zeros_like(coordinate), torch.zeros_like(coordinate)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    shifted = coordinate - low
    sign = torch.where(shifted < 0, -1.0, 1.0).to(coordinate.dtype)
    shifted = shifted.abs()
    extra = torch.fmod(shifted, span)
    even = torch.remainder(torch.floor(shifted / span), 2) == 0
    reflected = torch.where(even, extra + low, span - extra + low)
    return reflected, torch.where(even, sign, -sign)


def _unnormalize_set_grad(coordinate: Tensor, size: int, align_corners: bool) -> tuple[Tensor, float]:
    # PyTorch's grid_sampler_unnormalize_set_grad: [-1, 1] to pixel coordinates, and d source / d grid.
    if align_corners:
        return (coordinate + 1) / 2 * (size - 1), (size - 1) / 2
    return ((coordinate + 1) * size - 1) / 2, size / 2


def _source_set_grad(coordinate: Tensor, size: int, padding_mode: int, align_corners: bool) -> tuple[Tensor, Tensor]:
    """PyTorch's grid_sampler_compute_source_index_set_grad: (source coordinate, d source / d grid)."""
    source, multiplier = _unnormalize_set_grad(coordinate, size, align_corners)
    gradient = torch.full_like(coordinate, multiplier)
    if padding_mode == _BORDER:
        source, clip = _clip_set_grad(source, size)
        gradient = gradient * clip
    elif padding_mode == _REFLECTION:
        twice = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        source, reflect = _reflect_set_grad(source, *twice)
        source, clip = _clip_set_grad(source, size)
        gradient = gradient * reflect * clip
    return source, gradient


def _accumulate(input: Tensor, indices: list[Tensor], values: list[Tensor], compute: torch.dtype) -> Tensor:
    """``grad_input`` of ``input``'s shape and dtype: every ``[N, C, P]`` value added at its flat index.

    One ``index_put_(accumulate=True)``, in deterministic mode sorted and summed in a fixed order.
    """
    grad_input = torch.zeros(input.numel(), dtype=compute, device=input.device)
    grad_input.index_put_(
        (torch.cat(indices, dim=2).reshape(-1),), torch.cat(values, dim=2).reshape(-1), accumulate=True
    )
    return grad_input.view(input.shape).to(input.dtype)


def nearest_backward(
    grad_output: Tensor, input: Tensor, grid: Tensor, padding_mode: int, align_corners: bool, want_input: bool
) -> tuple[Tensor | None, Tensor]:
    """Nearest-mode ``grid_sample`` backward (2-D or 3-D): ``(grad_input or None, grad_grid = 0)``."""
    n, c = input.shape[:2]
    sizes = list(reversed(input.shape[2:]))  # along x, y[, z]: W, H[, D]
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    points = grid[..., 0].numel() // max(n, 1)
    grad_grid = torch.zeros_like(grid)
    if not want_input:
        return None, grad_grid
    coordinates = grid.reshape(n, points, len(sizes)).to(compute)
    index = torch.zeros(n, points, dtype=torch.long, device=input.device)
    inside = torch.ones(n, points, dtype=torch.bool, device=input.device)
    stride = 1
    for axis, size in enumerate(sizes):
        source, _ = _source_set_grad(coordinates[..., axis], size, padding_mode, align_corners)
        nearest = torch.round(source)  # half to even, as nearbyint
        inside &= (nearest >= 0) & (nearest <= size - 1)
        index += nearest.clamp(0, size - 1).long() * stride
        stride *= size
    plane_offsets = (torch.arange(n * c, device=input.device) * stride).view(n, c, 1)
    values = grad_output.reshape(n, c, points).to(compute) * inside.unsqueeze(1).to(compute)  # [N, C, P]
    grad_input = torch.zeros(n * c * stride, dtype=compute, device=input.device)
    grad_input.index_put_(((plane_offsets + index.unsqueeze(1)).reshape(-1),), values.reshape(-1), accumulate=True)
    return grad_input.view(input.shape).to(input.dtype), grad_grid


def _tap_coordinate(tap: Tensor, size: int, padding_mode: int, align_corners: bool) -> Tensor:
    # PyTorch's compute_coordinates on an integer tap position (bicubic's get/add_value_bounded).
    if padding_mode == _BORDER:
        return tap.clamp(0, size - 1)
    if padding_mode == _REFLECTION:
        twice = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        return _reflect_set_grad(tap, *twice)[0].clamp(0, size - 1)
    return tap


def _cubic_coefficients(t: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    # PyTorch's get_cubic_upsampling_coefficients and get_cubic_coefficients_grad (A = -0.75).
    a = -0.75
    values = [
        ((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a,
        ((a + 2) * t - (a + 3)) * t * t + 1,
        ((a + 2) * (1 - t) - (a + 3)) * (1 - t) * (1 - t) + 1,
        ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a,
    ]
    x0, x1, x2, x3 = -1 - t, -t, 1 - t, 2 - t
    slopes = [
        (-3 * a * x0 - 10 * a) * x0 - 8 * a,
        (-3 * (a + 2) * x1 - 2 * (a + 3)) * x1,
        (3 * (a + 2) * x2 - 2 * (a + 3)) * x2,
        (3 * a * x3 - 10 * a) * x3 + 8 * a,
    ]
    return values, slopes


def bicubic_backward(
    grad_output: Tensor, input: Tensor, grid: Tensor, padding_mode: int, align_corners: bool, want_input: bool
) -> tuple[Tensor | None, Tensor]:
    """Bicubic 2-D ``grid_sample`` backward: ``(grad_input or None, grad_grid)``, 16 taps per point."""
    n, c, height, width = input.shape
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    points = grid.shape[1] * grid.shape[2]
    coordinates = grid.reshape(n, points, 2).to(compute)
    axes = []  # per axis: (first tap, coefficients, their slopes, d source / d grid)
    for axis, size in enumerate((width, height)):
        source, multiplier = _unnormalize_set_grad(coordinates[..., axis], size, align_corners)
        first = torch.floor(source)
        coefficients, slopes = _cubic_coefficients(source - first)
        axes.append((first, coefficients, slopes, multiplier))
    gout = grad_output.reshape(n, c, points).to(compute)  # [N, C, P]
    flat_input = input.reshape(n, c, height * width).to(compute)
    plane_offsets = (torch.arange(n * c, device=input.device) * (height * width)).view(n, c, 1)
    grad_x = torch.zeros(n, points, dtype=compute, device=input.device)
    grad_y = torch.zeros_like(grad_x)
    corner_indices, corner_values = [], []
    (first_x, cx, sx, multiplier_x), (first_y, cy, sy, multiplier_y) = axes
    for i in range(4):
        x = _tap_coordinate(first_x - 1 + i, width, padding_mode, align_corners)
        for j in range(4):
            y = _tap_coordinate(first_y - 1 + j, height, padding_mode, align_corners)
            inside = (x >= 0) & (x <= width - 1) & (y >= 0) & (y <= height - 1)
            index = (y.clamp(0, height - 1).long() * width + x.clamp(0, width - 1).long()).masked_fill(~inside, 0)
            mask = inside.unsqueeze(1).to(compute)  # [N, 1, P]
            values = flat_input.gather(2, index.unsqueeze(1).expand(n, c, points)) * mask
            dot = (gout * values).sum(1)  # [N, P]
            grad_x -= sx[i] * cy[j] * dot
            grad_y -= sy[j] * cx[i] * dot
            if want_input:
                corner_values.append(gout * (cx[i] * cy[j]).unsqueeze(1) * mask)
                corner_indices.append(plane_offsets + index.unsqueeze(1))
    grad_grid = torch.stack([grad_x * multiplier_x, grad_y * multiplier_y], dim=-1).reshape(grid.shape)
    grad_grid = grad_grid.to(grid.dtype)
    if not want_input:
        return None, grad_grid
    return _accumulate(input, corner_indices, corner_values, compute), grad_grid


def _backward(
    grad_output: Tensor,
    input: Tensor,
    grid: Tensor,
    interpolation_mode: int,
    padding_mode: int,
    align_corners: bool,
    output_mask: Sequence[bool],
) -> tuple[Tensor | None, Tensor]:
    if interpolation_mode == _NEAREST:
        return nearest_backward(grad_output, input, grid, padding_mode, align_corners, bool(output_mask[0]))
    n, c, depth, height, width = input.shape
    compute = torch.float64 if input.dtype == torch.float64 else torch.float32
    points = grid.shape[1] * grid.shape[2] * grid.shape[3]
    coordinates = grid.reshape(n, points, 3).to(compute)  # [N, P, (x, y, z)]
    sources, multipliers = [], []
    for axis, size in enumerate((width, height, depth)):
        source, multiplier = _source_set_grad(coordinates[..., axis], size, padding_mode, align_corners)
        sources.append(source)
        multipliers.append(multiplier)
    low = [torch.floor(source) for source in sources]  # x0, y0, z0: [N, P]
    fraction = [source - corner for source, corner in zip(sources, low)]
    gout = grad_output.reshape(n, c, points).to(compute)  # [N, C, P]
    flat_input = input.reshape(n, c, depth * height * width).to(compute)
    plane_offsets = (torch.arange(n * c, device=input.device) * (depth * height * width)).view(n, c, 1)
    want_input = bool(output_mask[0])
    corner_indices, corner_values = [], []
    grad_xyz = [torch.zeros(n, points, dtype=compute, device=input.device) for _ in range(3)]
    for dz in (0, 1):
        for dy in (0, 1):
            for dx in (0, 1):
                offsets = (dx, dy, dz)
                position = [corner + offset for corner, offset in zip(low, offsets)]
                inside = torch.ones_like(position[0], dtype=torch.bool)
                for coordinate, size in zip(position, (width, height, depth)):
                    inside &= (coordinate >= 0) & (coordinate <= size - 1)
                # per-axis weights and their derivatives along x, y, z
                weights = [f if o else 1 - f for f, o in zip(fraction, offsets)]
                slopes = [1.0 if o else -1.0 for o in offsets]
                x, y, z = (p.clamp(0, s - 1).long() for p, s in zip(position, (width, height, depth)))
                index = ((z * height + y) * width + x).masked_fill(~inside, 0)  # [N, P]
                mask = inside.unsqueeze(1).to(compute)  # [N, 1, P]
                values = flat_input.gather(2, index.unsqueeze(1).expand(n, c, points)) * mask
                # sum over channels of grad_output * corner value: [N, P]
                dot = (gout * values).sum(1)
                grad_xyz[0] += slopes[0] * weights[1] * weights[2] * dot
                grad_xyz[1] += slopes[1] * weights[0] * weights[2] * dot
                grad_xyz[2] += slopes[2] * weights[0] * weights[1] * dot
                if want_input:
                    weight = (weights[0] * weights[1] * weights[2]).unsqueeze(1) * mask  # [N, 1, P]
                    corner_values.append(gout * weight)
                    corner_indices.append(plane_offsets + index.unsqueeze(1))
    grad_grid = torch.stack([g * m for g, m in zip(grad_xyz, multipliers)], dim=-1)
    grad_grid = grad_grid.reshape(grid.shape).to(grid.dtype)
    if not want_input:
        return None, grad_grid
    return _accumulate(input, corner_indices, corner_values, compute), grad_grid


register_route(Route("grid_sampler_3d_backward", _backward, grid_sampler_3d_backward_unsupported_reason))
