"""Deterministic backward of adaptive average pooling (2-D, 3-D) routed at the dispatcher.

PyTorch's CUDA ``_adaptive_avg_pool2d_backward`` / ``_adaptive_avg_pool3d_backward`` are refused under
``torch.use_deterministic_algorithms(True)`` (``adaptive_avg_pool2d_backward_cuda does not have a
deterministic implementation``): they scatter with float ``atomicAdd``. They are reached by
``F.adaptive_avg_pool2d/3d``, ``nn.AdaptiveAvgPool2d/3d`` and ``F.interpolate(mode="area")``.

* covered: ``self`` ``[N, C, *spatial]`` or ``[C, *spatial]``, float16/bfloat16/float32/float64, any
  strides (channels-last in gives channels-last out, as PyTorch), empty batches, ``grad_output`` of
  ``self``'s dtype and device with the same leading dims and non-empty spatial dims. CUDA: a gather
  (``extensions/csrc/cuda/adaptive_avg_pool_backward.cu``); CPU: PyTorch's kernel.
* everything else goes to PyTorch's kernel: its result and its own errors.
"""

import torch
from torch import Tensor

from deepep_lightning.ops._guards import (
    fake_like_self,
    grad_and_self_device_reason,
    grad_and_self_reason,
    register_fakes,
)
from deepep_lightning.ops._routes import Route, register_route

__all__ = ["adaptive_avg_pool_backward_unsupported_reason"]


def adaptive_avg_pool_backward_unsupported_reason(grad_output: Tensor, self: Tensor, spatial: int) -> str | None:
    """Why the deterministic backward (``spatial`` = 2 or 3 dims) would hand these to PyTorch, or ``None``."""
    reason = grad_and_self_reason(grad_output, self, spatial)
    if reason is not None:
        return reason
    lead = self.dim() - spatial
    if grad_output.shape[:lead] != self.shape[:lead]:
        return f"grad_output {tuple(grad_output.shape)} does not match self {tuple(self.shape)}"
    if min(self.shape[lead:]) <= 0 or min(grad_output.shape[lead:]) <= 0:
        return "empty spatial sizes are left to PyTorch"
    return grad_and_self_device_reason(grad_output, self)


def _covers_2d(grad_output: Tensor, self: Tensor) -> str | None:
    return adaptive_avg_pool_backward_unsupported_reason(grad_output, self, 2)


def _covers_3d(grad_output: Tensor, self: Tensor) -> str | None:
    return adaptive_avg_pool_backward_unsupported_reason(grad_output, self, 3)


def _route_2d(grad_output: Tensor, self: Tensor) -> Tensor:
    return torch.ops.deepep_lightning.adaptive_avg_pool2d_backward.default(grad_output, self)


def _route_3d(grad_output: Tensor, self: Tensor) -> Tensor:
    return torch.ops.deepep_lightning.adaptive_avg_pool3d_backward.default(grad_output, self)


_fake = fake_like_self("adaptive_avg_pool_backward: grad_output/self ranks differ")
register_fakes(
    {"deepep_lightning::adaptive_avg_pool2d_backward": _fake, "deepep_lightning::adaptive_avg_pool3d_backward": _fake}
)
register_route(Route("_adaptive_avg_pool2d_backward", _route_2d, _covers_2d))
register_route(Route("_adaptive_avg_pool3d_backward", _route_3d, _covers_3d))
