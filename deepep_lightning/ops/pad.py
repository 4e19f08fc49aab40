"""Deterministic backward of reflection and replication padding (1-D, 2-D, 3-D) routed at the dispatcher.

PyTorch's CUDA ``reflection_pad{1,3}d_backward`` and ``replication_pad{1,2,3}d_backward`` add the
padded border into the input gradient with float ``atomicAdd`` and are refused under
``torch.use_deterministic_algorithms(True)``. ``F.pad(mode="reflect"/"replicate")`` reaches
``reflection_pad1d/3d`` on CUDA in deterministic mode (for replicate PyTorch itself switches to a
decomposition there); direct callers of the aten ops reach every one of them. ``reflection_pad2d_backward``
is not routed: PyTorch's CUDA kernel switches to a gather of its own in deterministic mode.

* covered: ``self`` of rank ``len(padding) / 2 + 1`` or ``+ 2``, float16/bfloat16/float32/float64, any
  strides (channels-last in gives channels-last out), empty batches, non-negative padding (below the input
  size for reflection), ``grad_output`` of ``self`` padded by ``padding``. CUDA: a gather
  (``extensions/csrc/cuda/pad_backward.cu``); CPU: PyTorch's kernel.
* everything else (negative padding, i.e. cropping, included) goes to PyTorch's kernel: its result and
  its own errors.
"""

from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor

from deepep_lightning.ops._guards import (
    fake_like_self,
    grad_and_self_device_reason,
    grad_and_self_reason,
    register_fakes,
)
from deepep_lightning.ops._routes import Route, register_route

__all__ = ["pad_backward_unsupported_reason"]


def pad_backward_unsupported_reason(
    grad_output: Tensor, self: Tensor, padding: Sequence[int], *, reflect: bool, spatial: int
) -> str | None:
    """Why the deterministic pad backward would hand these arguments to PyTorch, or ``None``."""
    reason = grad_and_self_reason(grad_output, self, spatial)
    if reason is not None:
        return reason
    padding = list(padding)
    if len(padding) != 2 * spatial or not all(isinstance(p, int) for p in padding):
        return f"padding {padding!r} does not have {2 * spatial} ints"
    if grad_output.shape[:-spatial] != self.shape[:-spatial]:
        return f"grad_output {tuple(grad_output.shape)} does not match self {tuple(self.shape)}"
    for axis in range(spatial):
        size, left, right = self.shape[-1 - axis], padding[2 * axis], padding[2 * axis + 1]
        if left < 0 or right < 0:
            return "negative padding (cropping) is left to PyTorch"
        if size <= 0 or grad_output.shape[-1 - axis] != size + left + right:
            return "sizes are left to PyTorch to validate"
        if reflect and (left >= size or right >= size):
            return "reflection padding not below the input size is left to PyTorch to validate"
    return grad_and_self_device_reason(grad_output, self)


def _reflection(grad_output: Tensor, self: Tensor, padding: Sequence[int]) -> Tensor:
    return torch.ops.deepep_lightning.reflection_pad_backward.default(grad_output, self, list(padding))


def _replication(grad_output: Tensor, self: Tensor, padding: Sequence[int]) -> Tensor:
    return torch.ops.deepep_lightning.replication_pad_backward.default(grad_output, self, list(padding))


_fake = fake_like_self("pad_backward: ranks of grad_output/self differ")
register_fakes(
    {"deepep_lightning::reflection_pad_backward": _fake, "deepep_lightning::replication_pad_backward": _fake}
)
#: Spatial ranks whose reflection backward PyTorch refuses in deterministic mode (2-D has its own gather).
_ROUTED_REFLECTION_RANKS = (1, 3)
for _spatial in (1, 2, 3):
    if _spatial in _ROUTED_REFLECTION_RANKS:
        register_route(
            Route(
                f"reflection_pad{_spatial}d_backward",
                _reflection,
                partial(pad_backward_unsupported_reason, reflect=True, spatial=_spatial),
            )
        )
    register_route(
        Route(
            f"replication_pad{_spatial}d_backward",
            _replication,
            partial(pad_backward_unsupported_reason, reflect=False, spatial=_spatial),
        )
    )
