"""Deterministic backward of torchvision's ``deform_conv2d`` (DCN v1/v2), routed at the dispatcher.

torchvision's CUDA ``_deform_conv2d_backward`` refuses deterministic mode (``compute_grad_input``): its
input gradient is a col2im that adds ``mask * w * column`` into the pixels around every deformable sample
with float ``atomicAdd``. The route replaces the whole backward and keeps torchvision's algorithm for the
rest. Per chunk of images (torchvision's: the largest divisor of the batch up to 32):

* ``columns = weight^T . grad_output`` per weight group, one matmul, laid out as torchvision's
  ``[C_in, kh * kw, images, out_h * out_w]``;
* ``torch.ops.deepep_lightning.deform_conv2d_grad_input`` (``extensions/csrc/deform_conv2d_backward.cpp``,
  ``cuda/deform_conv2d_backward.cu``): channel-independent (pixel, weight) entries per deformable sample,
  sorted by pixel, gathered in a fixed order, in place of the atomic col2im;
* ``torch.ops.deepep_lightning.deform_conv2d_sample_grads``: one thread per sample sums the offset and mask
  gradients over channels in order (torchvision's col2im_coord) and rewrites the columns it has read into the
  im2col (torchvision's deformable_im2col), so the bilinear corners are read once for both;
* ``grad_weight += grad_output . im2col^T`` per weight group, one matmul, chunks added in order.

``grad_bias`` is ``grad_output``'s sum. Bitwise reproducible, no float atomics, no host sync. Covered:
float16/bfloat16/float32/float64 (float16/bfloat16 accumulate in float32 where torchvision's kernels
accumulate in the input's dtype), groups, offset groups, with and without mask, empty batches. Without
torchvision nothing is registered.
"""

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


def _images_per_chunk(batch: int) -> int:
    """torchvision's ``n_parallel_imgs``: the largest divisor of ``batch`` not above 32."""
    return max(divisor for divisor in range(1, min(batch, 32) + 1) if batch % divisor == 0)


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
    batch, channels, height, width = input.shape
    out_channels, _, kernel_h, kernel_w = weight.shape
    positions = grad.shape[2] * grad.shape[3]
    grad_bias = grad.sum((0, 2, 3))
    weight_rows = weight.reshape(groups, out_channels // groups, -1)  # [G, Co/G, Ci/G * K]
    grad_weight = torch.zeros_like(weight_rows)
    if batch == 0:
        return (
            torch.zeros_like(input),
            grad_weight.view_as(weight),
            torch.zeros_like(offset),
            torch.zeros_like(mask),
            grad_bias,
        )
    sizes = (kernel_h, kernel_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w, offset_groups, use_mask)
    grad_inputs, grad_offsets, grad_masks = [], [], []
    images = _images_per_chunk(batch)
    for first in range(0, batch, images):
        chunk = slice(first, first + images)
        grad_rows = (
            grad[chunk].reshape(images, groups, out_channels // groups, positions).permute(1, 2, 0, 3)
        ).reshape(groups, out_channels // groups, images * positions)  # [G, Co/G, images * L]
        columns = torch.matmul(weight_rows.transpose(1, 2), grad_rows)  # [G, Ci/G * K, images * L]
        layout = columns.view(channels, kernel_h * kernel_w, images, positions)
        chunk_offset, chunk_mask = offset[chunk], (mask[chunk] if use_mask else mask)  # else torchvision's [N, 1]
        grad_inputs.append(
            torch.ops.deepep_lightning.deform_conv2d_grad_input.default(
                layout, chunk_offset, chunk_mask, height, width, *sizes
            )
        )
        grad_offset, grad_mask = torch.ops.deepep_lightning.deform_conv2d_sample_grads.default(
            layout, input[chunk], chunk_offset, chunk_mask, *sizes
        )  # columns now hold the im2col
        grad_offsets.append(grad_offset)
        grad_masks.append(grad_mask)
        grad_weight.baddbmm_(grad_rows, columns.transpose(1, 2))

    def joined(pieces):
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    grad_mask = joined(grad_masks) if use_mask else torch.zeros_like(mask)
    return joined(grad_inputs), grad_weight.view_as(weight), joined(grad_offsets), grad_mask, grad_bias


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
    torch._check(columns.dim() == 4, lambda: f"{_OP}: columns must be 4-D [C, K, N, L], got {tuple(columns.shape)}")
    return columns.new_empty((columns.shape[2], columns.shape[0], height, width))


def _fake_sample_grads(columns, input, offset, mask, *rest):
    return offset.new_empty(offset.shape), mask.new_empty(mask.shape)


def _register_fake() -> None:
    torch.library.register_fake(f"deepep_lightning::{_OP}")(_fake_grad_input)
    torch.library.register_fake("deepep_lightning::deform_conv2d_sample_grads")(_fake_sample_grads)


on_extension_loaded(_register_fake)

if _torchvision_entry.torchvision_ops_available():
    register_route(
        Route("_deform_conv2d_backward", _route, deform_conv2d_backward_unsupported_reason, namespace="torchvision")
    )
