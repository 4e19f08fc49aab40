"""Deterministic backward of torchvision's ``deform_conv2d`` (DCN v1/v2), routed at the dispatcher.

torchvision's CUDA ``_deform_conv2d_backward`` refuses deterministic mode (``compute_grad_input``): its
input gradient is a col2im that adds ``mask * w * column`` into the pixels around every deformable sample
with float ``atomicAdd``. Its other gradients are gathers and GEMMs (weight: ``grad_output . im2col``;
offset and mask: one thread per element summing over channels in a fixed order; bias: a sum), which are
deterministic. So the route

* runs torchvision's own kernel with deterministic mode suspended for the duration of that one call, and
  keeps its weight, offset, mask and bias gradients;
* replaces its input gradient: ``columns = weight^T . grad_output`` per group (a batched matmul), then
  ``torch.ops.deepep_lightning.deform_conv2d_grad_input`` (``extensions/csrc/deform_conv2d_backward.cpp``,
  ``cuda/deform_conv2d_backward.cu``): channel-independent (pixel, weight) entries per deformable sample,
  sorted by pixel, gathered in a fixed order. Bitwise reproducible, no float atomics, no host sync.

Suspending deterministic mode is process-global for the length of torchvision's call: another thread that
checks the flag in that window sees it off. Covered: float16/bfloat16/float32/float64 (as far as
torchvision's kernel takes them), groups, offset groups, with and without mask, empty batches.
Without torchvision nothing is registered.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from deepep_lightning.ops import _torchvision_entry
from deepep_lightning.ops._guards import FLOAT_DTYPES, kernels_reason
from deepep_lightning.ops._routes import Route, register_route
from deepep_lightning.ops.extension_loader import on_extension_loaded

__all__ = ["deform_conv2d_backward", "deform_conv2d_backward_unsupported_reason"]

_OP = "deform_conv2d_grad_input"
_INT32_LIMIT = 2**31 - 1


def deform_conv2d_backward_unsupported_reason(
    grad: Tensor,
    input: Tensor,
    weight: Tensor,
    offset: Tensor,
    mask: Tensor,
    bias: Tensor,
    stride_h: int,
    stride_w: int,
    pad_h: int,
    pad_w: int,
    dilation_h: int,
    dilation_w: int,
    groups: int,
    offset_groups: int,
    use_mask: bool,
) -> str | None:
    """Why :func:`deform_conv2d_backward` leaves these arguments to torchvision, or ``None``. Metadata only."""
    tensors = (grad, input, weight, offset, mask, bias)
    if not all(isinstance(tensor, Tensor) for tensor in tensors):
        return "grad, input, weight, offset, mask and bias must be torch.Tensor"
    if torch.overrides.has_torch_function(tensors):
        return "tensor subclasses with __torch_function__ are left to torchvision"
    if input.dtype not in FLOAT_DTYPES or any(t.dtype != input.dtype for t in (grad, weight, offset)):
        return f"dtypes {[t.dtype for t in tensors]} are not one of {list(FLOAT_DTYPES)} for all"
    sizes = (stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, groups, offset_groups)
    if not all(isinstance(size, int) and not isinstance(size, bool) for size in sizes) or not isinstance(
        use_mask, bool
    ):
        return f"sizes {sizes!r} must be ints and use_mask {use_mask!r} a bool"
    if min(stride_h, stride_w, dilation_h, dilation_w, groups, offset_groups) <= 0 or min(pad_h, pad_w) < 0:
        return f"strides, dilations, groups must be positive and paddings >= 0, got {sizes!r}"
    if any(t.dim() != 4 for t in (grad, input, weight, offset)):
        return "grad, input, weight and offset must be 4-D"
    batch, channels, height, width = input.shape
    out_channels, _, kernel_h, kernel_w = weight.shape
    taps = kernel_h * kernel_w
    if channels % offset_groups or channels % groups or out_channels % groups or weight.shape[1] * groups != channels:
        return f"channels {channels} do not split into groups {groups} / offset_groups {offset_groups} as weight says"
    expected_offset = (batch, 2 * offset_groups * taps, grad.shape[2], grad.shape[3])
    if tuple(grad.shape[:2]) != (batch, out_channels) or tuple(offset.shape) != expected_offset:
        return f"grad {tuple(grad.shape)} / offset {tuple(offset.shape)} do not match input and weight"
    if use_mask and (mask.dtype != input.dtype or tuple(mask.shape) != (batch, offset_groups * taps, *grad.shape[2:])):
        return f"mask of {mask.dtype} {tuple(mask.shape)} does not match offset {tuple(offset.shape)}"
    positions = grad.shape[2] * grad.shape[3]
    if (
        batch * offset_groups * height * width >= _INT32_LIMIT
        or batch * offset_groups * taps * positions >= _INT32_LIMIT
    ):
        return "N * offset_groups * H * W and N * offset_groups * kh * kw * out_h * out_w must be below 2^31 - 1"
    if any(t.device != input.device for t in tensors):
        return "the tensors are on different devices"
    return kernels_reason(input)


@contextlib.contextmanager
def _deterministic_mode_suspended() -> Iterator[None]:
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def _columns(grad: Tensor, weight: Tensor, groups: int) -> Tensor:
    """``weight^T . grad`` per group: ``[N, C_in, kh * kw, out_h * out_w]``."""
    batch, out_channels = grad.shape[:2]
    taps = weight.shape[2] * weight.shape[3]
    per_group = weight.reshape(groups, out_channels // groups, -1)  # [G, Co/G, Ci/G * K]
    grad_rows = grad.reshape(batch, groups, out_channels // groups, -1)  # [N, G, Co/G, L]
    columns = torch.matmul(per_group.transpose(1, 2).unsqueeze(0), grad_rows)  # [N, G, Ci/G * K, L]
    return columns.reshape(batch, weight.shape[1] * groups, taps, -1)


def _route(
    grad,
    input,
    weight,
    offset,
    mask,
    bias,
    stride_h,
    stride_w,
    pad_h,
    pad_w,
    dilation_h,
    dilation_w,
    groups,
    offset_groups,
    use_mask,
):
    arguments = (grad, input, weight, offset, mask, bias, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w)
    with _deterministic_mode_suspended():  # torchvision's kernel: its grad_input is replaced below
        _, grad_weight, grad_offset, grad_mask, grad_bias = torch.ops.torchvision._deform_conv2d_backward.default(
            *arguments, groups, offset_groups, use_mask
        )
    grad_input = torch.ops.deepep_lightning.deform_conv2d_grad_input.default(
        _columns(grad, weight, groups),
        offset,
        mask,
        input.shape[2],
        input.shape[3],
        weight.shape[2],
        weight.shape[3],
        stride_h,
        stride_w,
        pad_h,
        pad_w,
        dilation_h,
        dilation_w,
        offset_groups,
        use_mask,
    )
    return grad_input, grad_weight, grad_offset, grad_mask, grad_bias


def deform_conv2d_backward(*arguments) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``torchvision::_deform_conv2d_backward`` (same arguments, same results to rounding), deterministic.

    Args:
        arguments: torchvision's ``(grad, input, weight, offset, mask, bias, stride_h, stride_w, pad_h,
            pad_w, dilation_h, dilation_w, groups, offset_groups, use_mask)``.

    Returns:
        ``(grad_input, grad_weight, grad_offset, grad_mask, grad_bias)``.

    Raises:
        ValueError: arguments the kernel does not take (the reason names them).
    """
    if len(arguments) != 15:
        raise ValueError(f"deform_conv2d_backward: 15 arguments expected (torchvision's schema), got {len(arguments)}")
    reason = deform_conv2d_backward_unsupported_reason(*arguments)
    if reason is not None:
        raise ValueError(f"deform_conv2d_backward: {reason}")
    return _route(*arguments)


def _fake_grad_input(columns, offset, mask, height, width, *rest):
    torch._check(columns.dim() == 4, lambda: f"{_OP}: columns must be 4-D [N, C, K, L], got {tuple(columns.shape)}")
    return columns.new_empty((columns.shape[0], columns.shape[1], height, width))


def _register_fake() -> None:
    torch.library.register_fake(f"deepep_lightning::{_OP}")(_fake_grad_input)


on_extension_loaded(_register_fake)

if _torchvision_entry.torchvision_ops_available():
    register_route(
        Route("_deform_conv2d_backward", _route, deform_conv2d_backward_unsupported_reason, namespace="torchvision")
    )
