"""Deterministic backward of ``avg_pool3d`` routed at the dispatcher.

PyTorch's CUDA ``avg_pool3d_backward`` scatters with float ``atomicAdd`` and is refused under
``torch.use_deterministic_algorithms(True)`` (``avg_pool3d_backward_cuda does not have a deterministic
implementation``); ``F.avg_pool3d`` and ``nn.AvgPool3d`` reach it.

* covered: ``self`` ``[N, C, D, H, W]`` or ``[C, D, H, W]``, float16/bfloat16/float32/float64, any strides
  (channels-last-3d in gives channels-last-3d out), empty batches; every ``kernel_size``/``stride``/
  ``padding`` PyTorch accepts (1 or 3 entries, empty ``stride`` meaning ``kernel_size``), ``ceil_mode``,
  ``count_include_pad``, ``divisor_override``. CUDA: a gather (``extensions/csrc/cuda/avg_pool3d_backward.cu``);
  CPU: PyTorch's kernel.
* everything else goes to PyTorch's kernel: its result and its own errors.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from deepep_lightning.ops._guards import (
    fake_like_self,
    grad_and_self_device_reason,
    grad_and_self_reason,
    register_fakes,
)
from deepep_lightning.ops._routes import Route, register_route

__all__ = ["avg_pool3d_backward_unsupported_reason"]


def _triple(values: Sequence[int], default: Sequence[int] | None = None) -> list[int] | None:
    values = list(values)
    if not values and default is not None:
        return list(default)
    if len(values) == 1:
        return values * 3
    return values if len(values) == 3 else None


def _expanded(kernel_size, stride, padding) -> tuple[list[int], list[int], list[int]] | None:
    kernel = _triple(kernel_size)
    if kernel is None:
        return None
    strides, pads = _triple(stride, kernel), _triple(padding)
    if strides is None or pads is None:
        return None
    return kernel, strides, pads


def avg_pool3d_backward_unsupported_reason(
    grad_output: Tensor,
    self: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> str | None:
    """Why the deterministic ``avg_pool3d_backward`` would hand these arguments to PyTorch, or ``None``."""
    reason = grad_and_self_reason(grad_output, self, 3)
    if reason is not None:
        return reason
    if grad_output.shape[:-3] != self.shape[:-3] or min(self.shape[-3:]) <= 0:
        return f"grad_output {tuple(grad_output.shape)} / self {tuple(self.shape)}: left to PyTorch to validate"
    expanded = _expanded(kernel_size, stride, padding)
    if expanded is None:
        return "kernel_size/stride/padding are left to PyTorch to validate"
    for k, s, p in zip(*expanded):
        if k <= 0 or s <= 0 or p < 0 or p > k // 2:
            return "kernel_size/stride/padding are left to PyTorch to validate"
    if divisor_override is not None and divisor_override == 0:
        return "divisor_override=0 is left to PyTorch to validate"
    return grad_and_self_device_reason(grad_output, self)


def _route(
    grad_output: Tensor,
    self: Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> Tensor:
    expanded = _expanded(kernel_size, stride, padding)
    assert expanded is not None  # covers() returned None
    kernel, strides, pads = expanded
    return torch.ops.deepep_lightning.avg_pool3d_backward.default(
        grad_output, self, kernel, strides, pads, ceil_mode, count_include_pad, divisor_override
    )


register_fakes(
    {"deepep_lightning::avg_pool3d_backward": fake_like_self("avg_pool3d_backward: ranks of grad_output/self differ")}
)
register_route(Route("avg_pool3d_backward", _route, avg_pool3d_backward_unsupported_reason))
