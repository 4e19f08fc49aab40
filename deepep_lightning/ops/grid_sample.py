"""``grid_sample`` with a deterministic backward: a drop-in for ``torch.nn.functional.grid_sample``.

Under ``torch.use_deterministic_algorithms(True)`` PyTorch refuses the CUDA backward of
``grid_sample`` (``grid_sampler_2d_backward_cuda does not have a deterministic implementation``)
because it scatters gradients with float ``atomicAdd``. :func:`grid_sample` runs PyTorch's own
forward (``torch.grid_sampler``, cuDNN path included, so the output is bit for bit
``F.grid_sample``'s) and, for the covered case, the backward of ``torch.ops.deepep_lightning``:

* covered: 4-D input ``[N, C, H, W]``, ``mode="bilinear"``, every ``padding_mode`` ("zeros",
  "border", "reflection"), both ``align_corners``, float16/bfloat16/float32/float64, plain
  tensors (no ``__torch_function__`` subclasses). CUDA: sort + fixed-order segmented gather
  (``extensions/csrc/cuda/grid_sample_backward.cu``), bitwise reproducible. CPU: PyTorch's CPU
  backward, which is already deterministic.
* at the dispatcher (``deepep_lightning.ops._routes``), the same backward serves
  ``aten::grid_sampler_2d_backward`` on CUDA in deterministic mode, so ``F.grid_sample`` itself,
  ``torch.grid_sampler`` and every other caller are covered once routing is on. The route also
  serves ``mode="nearest"`` and ``"bicubic"`` (composed from PyTorch ops,
  :mod:`deepep_lightning.ops.grid_sample_decomposed`).
* ``aten::cudnn_grid_sampler_backward``: ``F.grid_sample`` takes cuDNN's sampler for 4-D bilinear input
  with zeros padding and ``align_corners=True``. cuDNN's backward adds with atomics, and PyTorch's
  deterministic mode does not flag it (no error, different bits on every run); the route serves it with the
  same deterministic kernel (zeros padding, ``align_corners=True``).
* everything else (``mode="nearest"``/``"bicubic"``, 5-D input, integer dtypes, no compiled
  extension, a CUDA tensor without the CUDA kernels) is handed to ``F.grid_sample`` unchanged:
  same result, and PyTorch's own error where PyTorch raises (also its deterministic-mode error).
"""

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from deepep_lightning.ops._guards import FLOAT_DTYPES, kernels_reason
from deepep_lightning.ops._routes import Route, register_route
from deepep_lightning.ops.extension_loader import register_op_python_side
from deepep_lightning.ops.grid_sample_decomposed import (
    bicubic_backward,
    decomposed_backward_unsupported_reason,
    nearest_backward,
)

__all__ = ["grid_sample", "grid_sample_unsupported_reason"]

_OP = "grid_sample"
_PADDING_MODES = {"zeros": 0, "border": 1, "reflection": 2}
_DTYPES = FLOAT_DTYPES
_PADDING_NAMES = {code: name for name, code in _PADDING_MODES.items()}
_torch_grid_sample = F.grid_sample


def grid_sample_unsupported_reason(
    input: Tensor, grid: Tensor, mode: str = "bilinear", padding_mode: str = "zeros"
) -> str | None:
    """Why :func:`grid_sample` would hand these arguments to PyTorch, or ``None`` when it covers them."""
    if not isinstance(input, Tensor) or not isinstance(grid, Tensor):
        return "input and grid must be torch.Tensor"
    if torch.overrides.has_torch_function_variadic(input, grid):
        return "tensor subclasses with __torch_function__ are left to PyTorch"
    if mode != "bilinear":
        return f"mode={mode!r} is not covered, only 'bilinear'"
    if not isinstance(padding_mode, str) or padding_mode not in _PADDING_MODES:
        return f"padding_mode={padding_mode!r} is not one of {sorted(_PADDING_MODES)}"
    if input.dim() != 4 or grid.dim() != 4:
        return f"only 4-D input/grid are covered, got {input.dim()}-D input and {grid.dim()}-D grid"
    if input.dtype not in _DTYPES or grid.dtype != input.dtype:
        return f"dtype {input.dtype} (grid {grid.dtype}) is not covered, only one of {list(_DTYPES)}"
    if grid.shape[3] != 2 or grid.shape[0] != input.shape[0] or input.shape[2] == 0 or input.shape[3] == 0:
        # PyTorch raises its own error for these; an exception from inside the compiled op crashed
        # torch 2.11 on the GPU machine (BENCHMARKS.md, "Known problem"), so they never reach it.
        return (
            f"grid of shape {tuple(grid.shape)} is not [N, H_out, W_out, 2] for input of shape "
            f"{tuple(input.shape)} with non-empty H_in, W_in"
        )
    if input.device != grid.device:
        return "input and grid are on different devices"
    return kernels_reason(input)


def grid_sample(
    input: Tensor,
    grid: Tensor,
    mode: str = "bilinear",
    padding_mode: str = "zeros",
    align_corners: bool | None = None,
) -> Tensor:
    """``F.grid_sample`` (same signature, same forward) whose bilinear 2-D backward is deterministic.

    Args:
        input: ``[N, C, H_in, W_in]`` (other ranks go to ``F.grid_sample``).
        grid: ``[N, H_out, W_out, 2]`` sampling locations in ``[-1, 1]``, same dtype and device.
        mode: ``"bilinear"`` is covered; ``"nearest"``/``"bicubic"`` go to ``F.grid_sample``.
        padding_mode: ``"zeros"`` (default), ``"border"`` or ``"reflection"``.
        align_corners: as in ``F.grid_sample``; ``None`` means ``False`` with PyTorch's warning.

    Returns:
        ``[N, C, H_out, W_out]``, bitwise equal to ``F.grid_sample``'s output.

    Raises:
        ValueError: an unknown ``mode`` or ``padding_mode`` (PyTorch's own error).
        RuntimeError: shape/dtype errors from PyTorch's kernel; for uncovered arguments under
            deterministic mode, PyTorch's own "does not have a deterministic implementation".

    Example::

        >>> x = torch.randn(1, 3, 8, 8, requires_grad=True)
        >>> g = torch.rand(1, 4, 4, 2) * 2 - 1
        >>> grid_sample(x, g, align_corners=False).sum().backward()
        >>> x.grad.shape
        torch.Size([1, 3, 8, 8])
    """
    if grid_sample_unsupported_reason(input, grid, mode, padding_mode) is not None:
        return _torch_grid_sample(input, grid, mode=mode, padding_mode=padding_mode, align_corners=align_corners)
    if align_corners is None:
        warnings.warn(  # PyTorch's warning, so that the drop-in behaves alike
            "Default grid_sample and affine_grid behavior has changed "
            "to align_corners=False since 1.3.0. Please specify "
            "align_corners=True if the old behavior is desired. "
            "See the documentation of grid_sample for details.",
            stacklevel=2,
        )
        align_corners = False
    return torch.ops.deepep_lightning.grid_sample_bilinear2d.default(
        input, grid, _PADDING_MODES[padding_mode], bool(align_corners)
    )


def _fake_forward(input: Tensor, grid: Tensor, padding_mode: int, align_corners: bool) -> Tensor:
    torch._check(input.dim() == 4, lambda: f"{_OP}: input must be 4-D, got shape {tuple(input.shape)}")
    torch._check(
        grid.dim() == 4 and grid.shape[3] == 2 and grid.shape[0] == input.shape[0],
        lambda: (
            f"{_OP}: grid must be [N, H_out, W_out, 2] matching input {tuple(input.shape)}, got {tuple(grid.shape)}"
        ),
    )
    return input.new_empty((input.shape[0], input.shape[1], grid.shape[1], grid.shape[2]))


def _fake_backward(
    grad_output: Tensor, input: Tensor, grid: Tensor, padding_mode: int, align_corners: bool, input_requires_grad: bool
):
    torch._check(grad_output.dim() == 4, lambda: f"{_OP}_backward: grad_output must be 4-D")
    grad_input = input.new_empty(input.shape) if input_requires_grad else input.new_empty((0,))
    return grad_input, grid.new_empty(grid.shape)


# autograd is registered in C++ (extensions/csrc/refused_ops.cpp): no Python runs per backward
register_op_python_side("grid_sample_bilinear2d", _fake_forward, _fake_backward)


def _backward_route_covers(
    grad_output: Tensor,
    input: Tensor,
    grid: Tensor,
    interpolation_mode: int,
    padding_mode: int,
    align_corners: bool,
    output_mask: Sequence[bool],
) -> str | None:
    if interpolation_mode in (1, 2):  # nearest, bicubic: composed from PyTorch ops (grid_sample_decomposed.py)
        return decomposed_backward_unsupported_reason(grad_output, input, grid, padding_mode, 2)
    if interpolation_mode != 0:
        return f"interpolation_mode={interpolation_mode!r} is not one of 0, 1, 2 (bilinear, nearest, bicubic)"
    if padding_mode not in _PADDING_NAMES:
        return f"padding_mode={padding_mode!r} is not one of {sorted(_PADDING_NAMES)}"
    return _bilinear_backward_unsupported_reason(grad_output, input, grid, _PADDING_NAMES[padding_mode])


def _bilinear_backward_unsupported_reason(grad_output: Tensor, input: Tensor, grid: Tensor, padding: str) -> str | None:
    reason = grid_sample_unsupported_reason(input, grid, "bilinear", padding)
    if reason is not None:
        return reason
    expected = (input.shape[0], input.shape[1], grid.shape[1], grid.shape[2])
    if grad_output.dtype != input.dtype or tuple(grad_output.shape) != expected:
        return f"grad_output {grad_output.dtype} {tuple(grad_output.shape)} does not match {input.dtype} {expected}"
    return None


def _backward_route(
    grad_output: Tensor,
    input: Tensor,
    grid: Tensor,
    interpolation_mode: int,
    padding_mode: int,
    align_corners: bool,
    output_mask: Sequence[bool],
):
    if interpolation_mode in (1, 2):
        decomposed = nearest_backward if interpolation_mode == 1 else bicubic_backward
        return decomposed(grad_output, input, grid, padding_mode, align_corners, bool(output_mask[0]))
    grad_input, grad_grid = torch.ops.deepep_lightning.grid_sample_bilinear2d_backward.default(
        grad_output, input, grid, padding_mode, align_corners, bool(output_mask[0])
    )
    return (grad_input if output_mask[0] else None), grad_grid


register_route(Route("grid_sampler_2d_backward", _backward_route, _backward_route_covers))


def _cudnn_backward_route_covers(input: Tensor, grid: Tensor, grad_output: Tensor) -> str | None:
    return _bilinear_backward_unsupported_reason(grad_output, input, grid, "zeros")


def _cudnn_backward_route(input: Tensor, grid: Tensor, grad_output: Tensor) -> tuple[Tensor, Tensor]:
    # cuDNN's sampler is F.grid_sample's bilinear, zeros-padding, align_corners=True case
    return torch.ops.deepep_lightning.grid_sample_bilinear2d_backward.default(
        grad_output, input, grid, _PADDING_MODES["zeros"], True, True
    )


# F.grid_sample takes cuDNN's sampler for 4-D bilinear/zeros/align_corners=True inputs. Its backward adds
# with atomics and PyTorch's deterministic mode does not flag it: the runs differ silently.
register_route(Route("cudnn_grid_sampler_backward", _cudnn_backward_route, _cudnn_backward_route_covers))
