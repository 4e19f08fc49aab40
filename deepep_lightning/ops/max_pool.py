"""Deterministic argmax-scatter ops: the max-pooling backwards, ``max_unpool`` and ``embedding_bag`` "max".

The backward of a max pooling sends each output cell's gradient to the input element its saved index
points at; PyTorch's CUDA kernels for adaptive and 3-D max pooling do that with float ``atomicAdd`` and
refuse deterministic mode (``adaptive_max_pool2d_backward_cuda does not have a deterministic
implementation``). Here :func:`argmax_window_backward` (``torch.ops.deepep_lightning.argmax_window_backward``,
``extensions/csrc/cuda/max_pool_backward.cu``) sums each element's terms in a fixed order instead. Windows
``c`` apart along a dim (``c`` from kernel, stride and dilation, or from the adaptive window arithmetic)
never share an element, so where at most 8 such passes of disjoint windows cover the windows (a
non-overlapping pooling is one pass; kernel 3, stride 2 is 4 in 2-D and 8 in 3-D; float16/bfloat16 only
one pass, so no partial sum is rounded to the narrow type) each pass adds its windows' gradients to their
argmax elements with plain adds, pass after pass; otherwise one thread per input element gathers (in float),
in a fixed order, from the few windows that can hold it. No sort, no float atomics: bitwise reproducible,
the same bits on CPU and CUDA, and a sample's result does not depend on the batch.
Only windows that can hold an element count it, so the indices must be the forward's (as for PyTorch's
own max_pool2d backward).

Fractional max pooling's windows are known only through the saved indices, and ``embedding_bag``'s
"max" rows are arbitrary: those are one sorted, fixed-order
:func:`~deepep_lightning.ops.scatter.segment_scatter_add` (:func:`argmax_scatter_backward`).

``max_unpool2d`` / ``max_unpool3d`` forwards (PyTorch: ``max_unpooling2d_forward_out does not have a
deterministic implementation``) are scatters that overwrite: with duplicate indices the entry with the
largest position wins, as in PyTorch's CPU loop. :func:`max_unpool` (``torch.ops.deepep_lightning.max_unpool_forward``)
takes an integer ``atomicMax`` of the position per output cell (order-free) and then gathers.
Under ``torch.compile`` the routes give both ops a shape function (:mod:`~deepep_lightning.ops._tracing`):
PyTorch's Python decomposition, which raises PyTorch's deterministic-mode error while tracing, is set aside,
and the compiled graph calls the aten op, which the route serves, as eager calls, TorchScript and CUDA graphs do.

Routed at the dispatcher's CUDA key (:mod:`deepep_lightning.ops._routes`) in deterministic mode:
``adaptive_max_pool2d_backward``, ``adaptive_max_pool3d_backward``, ``max_pool3d_with_indices_backward``,
``fractional_max_pool2d_backward``, ``fractional_max_pool3d_backward``, ``max_unpool2d``,
``max_unpool3d``, ``_embedding_bag_dense_backward`` (mode "max"). Other modes, dtypes and devices run
PyTorch's kernel unchanged.
"""

import math

import torch
from torch import Tensor

from deepep_lightning.ops._guards import FLOAT_DTYPES, register_fakes
from deepep_lightning.ops._routes import Route, register_route
from deepep_lightning.ops.extension_loader import cuda_kernels_available

__all__ = ["argmax_scatter_backward", "argmax_window_backward", "max_unpool"]

_DTYPES = FLOAT_DTYPES
_MAX_ENTRIES = 2**31 - 2
_MAX_ROWS = 2**32 - 2
_EMBEDDING_BAG_MAX = 2


def _cuda_reason(*tensors: Tensor) -> str | None:
    if any(not isinstance(t, Tensor) for t in tensors):
        return "arguments must be tensors"
    first = tensors[0]
    if first.device.type != "cuda" or any(t.device != first.device for t in tensors):
        return "all tensors must be on one CUDA device"
    if torch.overrides.has_torch_function(tensors):
        return "tensor subclasses are left to PyTorch"
    if not cuda_kernels_available():
        return "the deepep_lightning CUDA kernels are not available"
    return None


def _planes_and_cells(input: Tensor, indices: Tensor, spatial_dims: int) -> str | None:
    if input.dim() not in (spatial_dims + 1, spatial_dims + 2) or indices.dim() != input.dim():
        return f"input must be {spatial_dims + 1}-D or {spatial_dims + 2}-D with indices of the same rank"
    if tuple(indices.shape[:-spatial_dims]) != tuple(input.shape[:-spatial_dims]):
        return "indices must have input's batch and channel sizes"
    if indices.dtype != torch.int64:
        return "indices must be int64"
    if indices.numel() > _MAX_ENTRIES or input.numel() > _MAX_ROWS:
        return "too many elements for the kernel's 32-bit keys"
    return None


def argmax_scatter_backward(grad_output: Tensor, input: Tensor, indices: Tensor, spatial_dims: int) -> Tensor:
    """``grad_input`` of a max pooling: ``grad_input[plane, indices[plane, j]] += grad_output[plane, j]``.

    Args:
        grad_output: ``[*planes, *out_spatial]`` gradient of the pooled output.
        input: the pooling's input ``[*planes, *in_spatial]`` (only its shape, dtype and memory format are read).
        indices: int64 ``[*planes, *out_spatial]``, flat positions in each ``in_spatial`` plane (the
            forward's ``return_indices``).
        spatial_dims: 2 or 3.

    Returns:
        ``grad_input`` shaped like ``input``, in ``input``'s suggested memory format (as PyTorch's kernels).

    Example::

        >>> x = torch.randn(1, 1, 4, 4)
        >>> y, i = torch.nn.functional.adaptive_max_pool2d(x, 2, return_indices=True)
        >>> argmax_scatter_backward(torch.ones_like(y), x, i, 2).sum()
        tensor(4.)
    """
    from deepep_lightning.ops.scatter import segment_scatter_add

    in_cells = math.prod(input.shape[-spatial_dims:])
    planes = math.prod(input.shape[:-spatial_dims])
    out_cells = math.prod(indices.shape[-spatial_dims:])
    offsets = torch.arange(planes, device=indices.device, dtype=torch.int64).mul_(in_cells).view(planes, 1)
    keys = (indices.reshape(planes, out_cells) + offsets).reshape(-1)  # channels-last indices do not view
    grad = segment_scatter_add(grad_output.reshape(-1), keys, planes * in_cells)
    return grad.view(input.shape).contiguous(memory_format=_suggested_memory_format(input))


def argmax_window_backward(
    grad_output: Tensor,
    input: Tensor,
    indices: Tensor,
    spatial_dims: int,
    kernel_size: list[int] | None = None,
    stride: list[int] | None = None,
    padding: list[int] | None = None,
    dilation: list[int] | None = None,
) -> Tensor:
    """``grad_input`` of a max pooling: each input element's sum over the windows whose saved index it is.

    Args:
        grad_output: ``[*planes, *out_spatial]`` gradient of the pooled output.
        input: the pooling's input ``[*planes, *in_spatial]`` (only its shape and memory format are read).
        indices: int64 ``[*planes, *out_spatial]``, the forward's ``return_indices``.
        spatial_dims: 2 or 3.
        kernel_size, stride, padding, dilation: the pooling's windows, ``spatial_dims`` ints each; all
            ``None`` (default) for an adaptive max pooling.

    Returns:
        ``grad_input`` shaped like ``input``, in ``input``'s suggested memory format (as PyTorch's kernels).

    Example::

        >>> x = torch.randn(1, 1, 4, 4)
        >>> y, i = torch.nn.functional.adaptive_max_pool2d(x, 2, return_indices=True)
        >>> argmax_window_backward(torch.ones_like(y), x, i, 2).sum()
        tensor(4.)
    """
    windows = [list(w) if w is not None else [] for w in (kernel_size, stride, padding, dilation)]
    grad = torch.ops.deepep_lightning.argmax_window_backward.default(
        grad_output, indices, list(input.shape[-spatial_dims:]), *windows
    )
    return grad.contiguous(memory_format=_suggested_memory_format(input))


def _argmax_window_fake(grad_output, indices, input_size, kernel_size, stride, padding, dilation):
    torch._check(
        grad_output.shape == indices.shape,
        lambda: (
            f"argmax_window_backward: indices {tuple(indices.shape)} must have grad_output's shape "
            f"{tuple(grad_output.shape)}"
        ),
    )
    return grad_output.new_empty(tuple(grad_output.shape[: -len(input_size)]) + tuple(input_size))


def _max_unpool_fake(self, indices, output_size):
    torch._check(self.shape == indices.shape, lambda: "max_unpool_forward: indices must have self's shape")
    return self.new_empty(tuple(self.shape[: -len(output_size)]) + tuple(output_size))


register_fakes(
    {
        "deepep_lightning::argmax_window_backward": _argmax_window_fake,
        "deepep_lightning::max_unpool_forward": _max_unpool_fake,
    }
)


def _suggested_memory_format(tensor: Tensor) -> torch.memory_format:
    """ATen's ``suggest_memory_format``: channels-last when the strides are channels-last and not contiguous."""
    if tensor.is_contiguous():
        return torch.contiguous_format
    if tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if tensor.dim() == 5 and tensor.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _pool_backward_reason(grad_output, input, indices, spatial_dims) -> str | None:
    reason = _cuda_reason(grad_output, input, indices)
    if reason is not None:
        return reason
    if grad_output.dtype not in _DTYPES or input.dtype != grad_output.dtype:
        return f"dtype {grad_output.dtype} is not covered"
    reason = _planes_and_cells(input, indices, spatial_dims)
    if reason is not None:
        return reason
    if grad_output.shape != indices.shape:
        return "grad_output and indices must have one shape"
    return None


def _adaptive2d_covers(grad_output, self, indices):
    return _pool_backward_reason(grad_output, self, indices, 2)


def _adaptive3d_covers(grad_output, self, indices):
    return _pool_backward_reason(grad_output, self, indices, 3)


def _adaptive2d(grad_output, self, indices):
    return argmax_window_backward(grad_output, self, indices, 2)


def _adaptive3d(grad_output, self, indices):
    return argmax_window_backward(grad_output, self, indices, 3)


def _triple(values, default=None) -> list[int] | None:
    """PyTorch's 3-D pooling argument convention: one int for all dims, or three; empty means ``default``."""
    values = list(values)
    if not values and default is not None:
        return default
    if len(values) == 1:
        values = values * 3
    if len(values) != 3 or any(not isinstance(v, int) for v in values):
        return None
    return values


def _max_pool3d_covers(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    kernel = _triple(kernel_size)
    windows = (kernel, _triple(stride, kernel), _triple(padding), _triple(dilation))
    if any(w is None for w in windows):
        return "kernel_size, stride, padding and dilation must be 1 or 3 ints"
    if min(kernel + windows[1] + windows[3]) <= 0 or min(windows[2]) < 0:
        return "kernel_size, stride and dilation must be positive, padding >= 0"
    return _pool_backward_reason(grad_output, self, indices, 3)


def _max_pool3d(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    kernel = _triple(kernel_size)
    return argmax_window_backward(
        grad_output, self, indices, 3, kernel, _triple(stride, kernel), _triple(padding), _triple(dilation)
    )


def _fractional2d_covers(grad_output, self, kernel_size, output_size, indices):
    return _pool_backward_reason(grad_output, self, indices, 2)


def _fractional3d_covers(grad_output, self, kernel_size, output_size, indices):
    return _pool_backward_reason(grad_output, self, indices, 3)


def _fractional2d(grad_output, self, kernel_size, output_size, indices):
    return argmax_scatter_backward(grad_output, self, indices, 2)


def _fractional3d(grad_output, self, kernel_size, output_size, indices):
    return argmax_scatter_backward(grad_output, self, indices, 3)


def max_unpool(input: Tensor, indices: Tensor, output_size) -> Tensor:
    """Deterministic ``max_unpool{2,3}d`` forward: ``out[plane, indices[plane, j]] = input[plane, j]``.

    With duplicate indices the largest ``j`` wins (PyTorch's CPU order); cells no index names are 0.
    ``output_size`` is the spatial output size (2 or 3 ints). An index outside the output plane is a
    device-side assert on CUDA, as in PyTorch.

    Example::

        >>> y, i = torch.nn.functional.max_pool2d(torch.randn(1, 1, 4, 4), 2, return_indices=True)
        >>> max_unpool(y, i, [4, 4]).shape
        torch.Size([1, 1, 4, 4])
    """
    return torch.ops.deepep_lightning.max_unpool_forward.default(input, indices, list(output_size))


def _unpool_reason(self, indices, output_size, spatial_dims) -> str | None:
    reason = _cuda_reason(self, indices)
    if reason is not None:
        return reason
    if self.dtype not in _DTYPES:
        return f"dtype {self.dtype} is not covered"
    if len(output_size) != spatial_dims or any(not isinstance(s, int) or s <= 0 for s in output_size):
        return "output_size must be positive ints"
    if self.dim() not in (spatial_dims + 1, spatial_dims + 2) or self.shape != indices.shape:
        return "self and indices must have one shape of the pool's rank"
    if indices.dtype != torch.int64 or self.numel() == 0:
        return "indices must be int64 and self non-empty"
    if math.prod(self.shape[-spatial_dims:]) > _MAX_ENTRIES:
        return "too many cells per plane for the kernel's 32-bit positions"
    return None


def _unpool2d_covers(self, indices, output_size):
    return _unpool_reason(self, indices, output_size, 2)


def _unpool3d_covers(self, indices, output_size, stride, padding):
    return _unpool_reason(self, indices, output_size, 3)


def _unpool2d(self, indices, output_size):
    return max_unpool(self, indices, list(output_size))


def _unpool2d_shape(self, indices, output_size):
    """The fake result torch.compile traces ``max_unpool2d`` with while routed (no alert, no compute)."""
    return _max_unpool_fake(self, indices, list(output_size))


def _unpool3d_shape(self, indices, output_size, stride, padding):
    return _max_unpool_fake(self, indices, list(output_size))


def _unpool3d(self, indices, output_size, stride, padding):
    return max_unpool(self, indices, list(output_size))


def _embedding_bag_covers(
    grad, indices, offset2bag, bag_size, maximum_indices, num_weights, scale_grad_by_freq, mode,
    per_sample_weights, padding_idx=-1,
):  # fmt: skip
    if mode != _EMBEDDING_BAG_MAX:
        return "only mode 'max' is refused (sum and mean are deterministic)"
    reason = _cuda_reason(grad, maximum_indices)
    if reason is not None:
        return reason
    if grad.dtype not in _DTYPES or grad.dim() != 2 or maximum_indices.shape != grad.shape:
        return "grad must be 2-D floating with maximum_indices of its shape"
    if maximum_indices.dtype not in (torch.int64, torch.int32) or per_sample_weights is not None:
        return "maximum_indices must be int32/int64 and per_sample_weights None"
    if not isinstance(num_weights, int) or (num_weights + 1) * grad.shape[1] > _MAX_ROWS:
        return "num_weights out of the kernel's range"
    if grad.numel() > _MAX_ENTRIES:
        return "too many elements for the kernel's 32-bit ids"
    return None


def _embedding_bag(
    grad, indices, offset2bag, bag_size, maximum_indices, num_weights, scale_grad_by_freq, mode,
    per_sample_weights, padding_idx=-1,
):  # fmt: skip
    from deepep_lightning.ops.scatter import segment_scatter_add

    features = grad.shape[1]
    rows = maximum_indices.to(torch.int64)
    # Empty bags (index -1) and padding_idx add nothing: they go to a spare row that is cut off.
    skipped = rows < 0
    if padding_idx >= 0:
        skipped = skipped | (rows == padding_idx)
    rows = torch.where(skipped, num_weights, rows)
    keys = (rows * features + torch.arange(features, device=rows.device)).view(-1)
    summed = segment_scatter_add(grad.reshape(-1), keys, (num_weights + 1) * features)
    return summed[: num_weights * features].view(num_weights, features)


for _route in (
    Route("adaptive_max_pool2d_backward", _adaptive2d, _adaptive2d_covers),
    Route("adaptive_max_pool3d_backward", _adaptive3d, _adaptive3d_covers),
    Route("max_pool3d_with_indices_backward", _max_pool3d, _max_pool3d_covers),
    Route("fractional_max_pool2d_backward", _fractional2d, _fractional2d_covers),
    Route("fractional_max_pool3d_backward", _fractional3d, _fractional3d_covers),
    Route("max_unpool2d", _unpool2d, _unpool2d_covers, shape_function=_unpool2d_shape),
    Route("max_unpool3d", _unpool3d, _unpool3d_covers, shape_function=_unpool3d_shape),
    Route("_embedding_bag_dense_backward", _embedding_bag, _embedding_bag_covers),
):
    register_route(_route)
