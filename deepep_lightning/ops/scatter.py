"""Deterministic scatter-add (:func:`segment_scatter_add`) and the ``index_add`` / ``scatter_add`` routes built on it.

PyTorch's CUDA ``index_add_`` and ``scatter_add_`` add with float ``atomicAdd``: the last bits of the
result change from run to run. In deterministic mode PyTorch switches them to its sort-based
``index_put_`` path, bitwise reproducible but several times slower. ``torch.ops.deepep_lightning.segment_scatter_add``
(``extensions/csrc/cuda/segment_scatter.cu``) sorts the indices stably and sums each output element in
a fixed order (chunked, so one hot index does not serialise it). Routed at the dispatcher's CUDA key
(:mod:`deepep_lightning.ops._routes`), in deterministic mode, for floating dtypes:

* ``index_add`` / ``index_add_`` / ``index_add.out``: 1-D int32/int64 index, ``source`` of ``self``'s
  dtype, any ``dim``;
* ``scatter_add`` / ``scatter_add_`` / ``scatter_add.out``: int64 index of ``self``'s rank (an index that
  repeats one row index across the other dims, ``index.view(-1, 1).expand_as(src)``, sorts one key per row,
  any other one key per element).

The routes sort an index once while it is alive and unchanged (:mod:`deepep_lightning.ops.sort_plans`): a
graph network's layers scatter along one ``edge_index`` row forward and backward, and every call after the
first sums with the first one's sort plan, the same bits in fewer launches.

Everything else runs PyTorch's kernel unchanged. ``index_put_(accumulate=True)`` (the backward of every
advanced-indexing gather: ``x[index]``, an MoE's token selection, a relative-position-bias table lookup) is
not routed: PyTorch's CUDA kernel sorts the indices and sums each row in a fixed order in every mode, so it
is bitwise reproducible already and deterministic mode costs it nothing. A route would put its Python wrapper
(5-20 us of host time a call on the H100, BENCHMARKS.md) on every ``index_put_`` call, masked assignments
included, and the zoo's attribution (``benchmarks/results/zoo/zoo.json``, measured with such a route) shows
what that costs: Swin-T, MaxViT-T, Mask R-CNN and the Mixtral-style MoE each spent 1.9-2.9 ms more host time
a step in it, and its sorted segment sums took longer on the GPU than PyTorch's kernel in both R-CNNs and the
MoE.

The argmax-scatter backwards whose windows are known only through their indices (fractional max pooling,
embedding_bag "max") use the same op (:mod:`deepep_lightning.ops.max_pool`).

Where it stands against PyTorch's atomic kernel: the cost is a stable radix sort of 32-bit keys over
only the ``ceil(log2(size))`` bits a row number can use, a binary search per row and two summing passes.
When many entries land on few rows the atomics serialise on the same addresses and the sort is cheaper
than they are; when the entries spread over many rows (mean segment of a few entries) the atomics barely
collide, and the sort makes this op several times slower than them (still faster than PyTorch's own
deterministic path). ``benchmarks/bench_refused_ops.py`` measures both regimes.
"""

import math

import torch
from torch import Tensor

from deepep_lightning.ops._guards import FLOAT_DTYPES
from deepep_lightning.ops._routes import Route, register_route
from deepep_lightning.ops.extension_loader import cuda_kernels_available, extension_available, on_extension_loaded
from deepep_lightning.ops.segments import INDEX_DTYPES
from deepep_lightning.ops.sort_plans import SORT_PLANS, is_plan_for

__all__ = ["segment_scatter_add", "segment_scatter_add_reference"]

_DTYPES = FLOAT_DTYPES
_MAX_ENTRIES = 2**31 - 2  # entry ids are int32 in the kernel
_MAX_ROWS = 2**32 - 2  # sort keys are uint32


def segment_scatter_add_reference(
    src: Tensor, index: Tensor, size: int, dim: int = 0, base: Tensor | None = None, alpha: float = 1.0
) -> Tensor:
    """The pure-PyTorch definition: ``(base.clone() or zeros).index_add_(dim, index, src, alpha=alpha)``."""
    shape = list(src.shape)
    shape[dim] = size
    out = base.clone() if base is not None else src.new_zeros(shape)
    return out.index_add_(dim, index, src, alpha=alpha)


def _unsupported_reason(src, index, size, dim, base) -> str | None:
    if not isinstance(src, Tensor) or not isinstance(index, Tensor):
        return "src and index must be torch.Tensor"
    if src.dtype not in _DTYPES:
        return f"src dtype {src.dtype} is not one of {list(_DTYPES)}"
    if src.device.type not in ("cpu", "cuda") or index.device != src.device:
        return f"src on {src.device} and index on {index.device} are not on one CPU or CUDA device"
    if src.dim() == 0 or not 0 <= dim < src.dim():
        return f"dim {dim} is not a dimension of src of shape {tuple(src.shape)}"
    if src.shape[dim] > _MAX_ENTRIES or size > _MAX_ROWS:
        return f"src.size(dim) = {src.shape[dim]} or size = {size} exceeds the kernel's 32-bit keys"
    if base is not None and (base.dtype != src.dtype or base.device != src.device):
        return "base must have src's dtype and device"
    if src.is_cuda and not cuda_kernels_available():
        return "the deepep_lightning CUDA kernels were not built (no nvcc?)"
    if not extension_available():
        return "the deepep_lightning C++ extension is not available"
    return None


def segment_scatter_add(
    src: Tensor,
    index: Tensor,
    size: int,
    dim: int = 0,
    base: Tensor | None = None,
    alpha: float = 1.0,
    plan: Tensor | None = None,
) -> Tensor:
    """Deterministic ``index_add``: ``out[..., index[i], ...] += alpha * src[..., i, ...]`` along ``dim``.

    Args:
        src: ``[*outer, n, *inner]`` floating tensor (float16/bfloat16/float32/float64), any strides.
        index: ``[n]`` int64/int32 rows in ``[0, size)`` (an index out of range is a device-side assert
            on CUDA, as in PyTorch's ``index_add_``).
        size: number of output rows along ``dim``.
        dim: the dimension of ``src`` that ``index`` runs along (default 0; negative counts from the end).
        base: ``[*outer, size, *inner]`` tensor to add to (default: zeros), same dtype and device as ``src``.
        alpha: scale of ``src`` (default 1).
        plan: ``segment_sort_plan(index, size)`` (:mod:`deepep_lightning.ops.sort_plans`), made while ``index``
            held its present values, or None (the op sorts ``index`` itself). The same bits either way.

    Returns:
        A new contiguous ``[*outer, size, *inner]`` tensor. On CUDA every element is summed in one fixed
        order (sorted by index, entry order within an index), in double, so it is bitwise reproducible.

    Raises:
        TypeError: ``src``/``index``/``base`` are not tensors, ``size``/``dim`` not ints.
        ValueError: a shape, dtype or device that the op does not take (the message names the argument).

    Example::

        >>> src = torch.ones(5, 2)
        >>> segment_scatter_add(src, torch.tensor([0, 2, 0, 1, 2]), 3)
        tensor([[2., 2.],
                [1., 1.],
                [2., 2.]])
    """
    if not isinstance(src, Tensor) or not isinstance(index, Tensor):
        raise TypeError(f"segment_scatter_add: src and index must be tensors, got {type(src)!r}, {type(index)!r}")
    if base is not None and not isinstance(base, Tensor):
        raise TypeError(f"segment_scatter_add: base must be a tensor or None, got {type(base)!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise TypeError(f"segment_scatter_add: size must be an int >= 0, got {size!r}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"segment_scatter_add: dim must be an int, got {dim!r}")
    if src.dim() == 0:
        raise ValueError(f"segment_scatter_add: src must have at least 1 dimension, got shape {tuple(src.shape)}")
    if not -src.dim() <= dim < src.dim():
        raise ValueError(f"segment_scatter_add: dim must be in [{-src.dim()}, {src.dim()}), got {dim!r}")
    dim %= src.dim()
    if not src.is_floating_point():
        raise ValueError(f"segment_scatter_add: src must be floating point, got {src.dtype}")
    if index.dim() != 1 or index.shape[0] != src.shape[dim] or index.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"segment_scatter_add: index must be 1-D int64/int32 of length src.shape[{dim}] = {src.shape[dim]}, "
            f"got {index.dtype} of shape {tuple(index.shape)}"
        )
    if index.device != src.device:
        raise ValueError(f"segment_scatter_add: index must be on src's device {src.device}, got {index.device}")
    shape = list(src.shape)
    shape[dim] = size
    if base is not None and (list(base.shape) != shape or base.dtype != src.dtype or base.device != src.device):
        raise ValueError(
            f"segment_scatter_add: base must be {src.dtype} of shape {tuple(shape)} on {src.device}, "
            f"got {base.dtype} of shape {tuple(base.shape)} on {base.device}"
        )
    if plan is not None and not is_plan_for(plan, index, size):
        raise ValueError(
            f"segment_scatter_add: plan must be segment_sort_plan(index, {size}): contiguous int32 of shape "
            f"({2 * index.shape[0] + size + 1},) on {index.device}, got {plan!r:.80}"
        )
    if _unsupported_reason(src, index, size, dim, base) is not None:
        return segment_scatter_add_reference(src, index, size, dim, base, float(alpha))
    return torch.ops.deepep_lightning.segment_scatter_add.default(src, index, size, dim, base, float(alpha), plan)


def _fake(src: Tensor, index: Tensor, size: int, dim: int = 0, base=None, alpha: float = 1.0, plan=None) -> Tensor:
    torch._check(0 <= dim < src.dim(), lambda: f"segment_scatter_add: dim {dim} out of range for {src.dim()}-D src")
    torch._check(
        index.dim() == 1 and index.shape[0] == src.shape[dim],
        lambda: f"segment_scatter_add: index must be [{src.shape[dim]}], got {tuple(index.shape)}",
    )
    shape = list(src.shape)
    shape[dim] = size
    return src.new_empty(shape)


def _setup_context(ctx, inputs, output) -> None:
    src, index, size, dim, base, alpha, _plan = inputs
    ctx.save_for_backward(index)
    ctx.dim, ctx.alpha, ctx.has_base = dim, alpha, base is not None


def _backward(ctx, grad_output):
    (index,) = ctx.saved_tensors
    grad_src = None
    if ctx.needs_input_grad[0]:
        grad_src = grad_output.index_select(ctx.dim, index)
        if ctx.alpha != 1.0:
            grad_src = grad_src * ctx.alpha
    grad_base = grad_output if ctx.has_base and ctx.needs_input_grad[4] else None
    return grad_src, None, None, None, grad_base, None, None


def _in_place_fake(self: Tensor, *args, **kwargs) -> None:
    """The fake kernel of an op that only writes into ``self`` (no outputs: nothing to describe)."""
    return None


def _register() -> None:
    torch.library.register_fake("deepep_lightning::segment_scatter_add")(_fake)
    torch.library.register_fake("deepep_lightning::segment_scatter_add_")(_in_place_fake)
    torch.library.register_autograd("deepep_lightning::segment_scatter_add", _backward, setup_context=_setup_context)


on_extension_loaded(_register)


# ---- routes: index_add, scatter_add ---------------------------------------------------------------------


def _route_reason(self: Tensor, *others: Tensor) -> str | None:
    if not isinstance(self, Tensor) or self.dtype not in _DTYPES:
        return "self must be a float16/bfloat16/float32/float64 tensor"
    if self.device.type != "cuda" or any(o.device != self.device for o in others):
        return "all tensors must be on self's CUDA device"
    if self.dim() == 0 or self.numel() > _MAX_ROWS:
        return f"self of shape {tuple(self.shape)} is not covered"
    if torch.overrides.has_torch_function(tuple((self, *others))):
        return "tensor subclasses are left to PyTorch"
    if not cuda_kernels_available():
        return "the deepep_lightning CUDA kernels are not available"
    return None


def _real_alpha(alpha) -> bool:
    return isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha)


def _index_add_covers(self, dim, index, source, *, alpha=1, out=None) -> str | None:
    if not isinstance(index, Tensor) or not isinstance(source, Tensor):
        return "index and source must be tensors"
    reason = _route_reason(self, index, source)
    if reason is not None:
        return reason
    if not -self.dim() <= dim < self.dim():
        return f"dim {dim} out of range"
    dim %= self.dim()
    if index.dim() != 1 or index.dtype not in INDEX_DTYPES or source.dtype != self.dtype:
        return "index must be 1-D int32/int64 and source of self's dtype"
    if source.dim() != self.dim() or source.shape[dim] != index.shape[0] or source.shape[dim] > _MAX_ENTRIES:
        return "source must have self's rank and index.numel() entries along dim"
    if any(source.shape[d] != self.shape[d] for d in range(self.dim()) if d != dim):
        return "source must match self outside dim"
    if not _real_alpha(alpha):
        return f"alpha {alpha!r} is not a finite real number"
    if out is not None and (out.dtype != self.dtype or out.device != self.device):
        return "out must have self's dtype and device"
    return None


def _index_add(self, dim, index, source, *, alpha=1):
    dim %= self.dim()
    size = self.shape[dim]
    plan = SORT_PLANS.plan(index, size)
    return torch.ops.deepep_lightning.segment_scatter_add.default(source, index, size, dim, self, float(alpha), plan)


def _index_add_inplace(self, dim, index, source, *, alpha=1):
    dim %= self.dim()
    plan = SORT_PLANS.plan(index, self.shape[dim])
    torch.ops.deepep_lightning.segment_scatter_add_.default(self, source, index, dim, float(alpha), plan)
    return self


def _write_out(out: Tensor, result: Tensor) -> Tensor:
    """``result`` written into ``out`` (resized first when the shapes differ), as an ``.out`` overload does."""
    if tuple(out.shape) != tuple(result.shape):
        out.resize_(result.shape)
    return out.copy_(result)


def _index_add_out(self, dim, index, source, *, alpha=1, out):
    return _write_out(out, _index_add(self, dim, index, source, alpha=alpha))


def _scatter_add_covers(self, dim, index, src, *, out=None) -> str | None:
    if not isinstance(index, Tensor) or not isinstance(src, Tensor):
        return "index and src must be tensors"
    reason = _route_reason(self, index, src)
    if reason is not None:
        return reason
    if index.dtype != torch.int64 or src.dtype != self.dtype:
        return "index must be int64 and src of self's dtype"
    if index.dim() != self.dim() or src.dim() != self.dim() or not -self.dim() <= dim < self.dim():
        return "index and src must have self's rank"
    dim %= self.dim()
    for d in range(self.dim()):
        if index.shape[d] > src.shape[d] or (d != dim and index.shape[d] > self.shape[d]):
            return "index must not exceed src (and self outside dim)"
    if index.numel() > _MAX_ENTRIES:
        return "index has too many entries for the kernel's 32-bit ids"
    if out is not None and (out.dtype != self.dtype or out.device != self.device):
        return "out must have self's dtype and device"
    return None


def _row_index(self: Tensor, dim: int, index: Tensor) -> Tensor | None:
    """The 1-D index along ``dim`` of an ``index`` that repeats it across every other dim of ``self``, or None.

    ``index.view(-1, 1).expand_as(src)`` (PyG's message passing, ``gather``/``scatter`` idioms) has stride 0
    outside ``dim`` and ``self``'s extent there: ``scatter_add`` is then an ``index_add`` of whole rows, which
    sorts ``index.shape[dim]`` keys instead of one per element.
    """
    shape, strides, self_shape = index.shape, index.stride(), self.shape
    for d in range(len(shape)):
        if d != dim and (shape[d] != self_shape[d] or (shape[d] > 1 and strides[d] != 0)):
            return None
    return index.as_strided((shape[dim],), (strides[dim],))


def _row_terms(self: Tensor, dim: int, index: Tensor, src: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(values, rows)`` with ``scatter_add == index_add(dim, rows, values)``, for a row-repeating ``index``."""
    rows = _row_index(self, dim, index) if index.numel() else None
    if rows is None:
        return None
    values = src if src.shape == index.shape else src[tuple(slice(0, n) for n in index.shape)]
    return values, rows  # the kernel asserts the rows lie in [0, size)


def _scatter_add(self, dim, index, src):
    dim %= self.dim()
    base = self.contiguous()
    if index.numel() == 0:
        return base.clone()
    terms = _row_terms(self, dim, index, src)
    if terms is not None:
        values, rows = terms
        size = base.shape[dim]
        plan = SORT_PLANS.plan(rows, size, view_of=index)
        return torch.ops.deepep_lightning.segment_scatter_add.default(values, rows, size, dim, base, 1.0, plan)
    return _scatter_add_elements(base, dim, index, src)


def _scatter_add_elements(base: Tensor, dim: int, index: Tensor, src: Tensor) -> Tensor:
    """``base.scatter_add(dim, index, src)`` for a contiguous ``base``, one sort key per index element."""
    torch._assert_async(((index >= 0) & (index < base.shape[dim])).all(), "scatter_add: index out of range")
    strides = base.stride()
    # Flat position in base of each index entry: index * stride[dim] + coordinate * stride[d], d != dim.
    flat = index * strides[dim]
    for d in range(base.dim()):
        if d != dim and index.shape[d] > 1:
            shape = [1] * base.dim()
            shape[d] = index.shape[d]
            flat = flat + torch.arange(index.shape[d], device=index.device).view(shape) * strides[d]
    values = src[tuple(slice(0, n) for n in index.shape)]
    summed = torch.ops.deepep_lightning.segment_scatter_add.default(
        values.reshape(-1), flat.reshape(-1), base.numel(), 0, base.view(-1), 1.0
    )
    return summed.view(base.shape)


def _scatter_add_inplace(self, dim, index, src):
    dim %= self.dim()
    if index.numel() == 0:
        return self
    terms = _row_terms(self, dim, index, src)
    if terms is None:  # one key per element: summed over a flat copy of self
        return self.copy_(_scatter_add_elements(self.contiguous(), dim, index, src))
    values, rows = terms
    plan = SORT_PLANS.plan(rows, self.shape[dim], view_of=index)
    torch.ops.deepep_lightning.segment_scatter_add_.default(self, values, rows, dim, 1.0, plan)
    return self


def _scatter_add_out(self, dim, index, src, *, out):
    return _write_out(out, _scatter_add(self, dim, index, src))


for _route in (
    Route("index_add", _index_add, _index_add_covers),
    Route("index_add_", _index_add_inplace, _index_add_covers),
    Route("index_add.out", _index_add_out, _index_add_covers),
    Route("scatter_add", _scatter_add, _scatter_add_covers),
    Route("scatter_add_", _scatter_add_inplace, _scatter_add_covers),
    Route("scatter_add.out", _scatter_add_out, _scatter_add_covers),
):
    register_route(_route)
