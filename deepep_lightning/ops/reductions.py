"""Deterministic indexed reductions: ``index_reduce`` (every reduction), ``scatter_reduce`` ("prod") and
``put_(accumulate=True)``, built from sorts, gathers and the fixed-order sums of
:func:`~deepep_lightning.ops.scatter.segment_scatter_add`.

PyTorch's CUDA kernels for these ops combine with atomics (``index_reduce_cuda``,
``scatter_reduce_cuda_prod_``, ``put_``) and refuse ``torch.use_deterministic_algorithms(True)``. Here
every output element is reduced in one fixed order, independent of thread scheduling:

* ``"mean"`` runs in the same one-op reduction as products (below): entries summed from ``self`` on in
  entry order (float16/bfloat16 in float), divided by the count; without the extension it is a
  :func:`segment_scatter_add` sum and a division;
* ``put_`` sums are one sorted, fixed-order :func:`segment_scatter_add` (floating dtypes; integer sums are
  exact in any order and use PyTorch's own ``index_put_``);
* products, maxima and minima sort the keys stably and combine each key's entries left to right, one
  thread per output element, then combine with ``self`` in the same launch
  (:func:`~deepep_lightning.ops.segments.segment_reduce`: one op call, the sort and two kernels on CUDA).
  No logarithms, so zeros, signs and integer wrap-around are those of plain products; the entries are
  combined from ``self`` on in PyTorch's sequential order, so the results are those of PyTorch's CPU
  ``index_reduce`` bitwise (of its ``scatter_reduce`` too, except float16/bfloat16, which it keeps in
  float between entries); NaN propagates, as in PyTorch's ``"amax"``/``"amin"``.

``include_self`` follows PyTorch: ``True`` combines the entries with ``self``; ``False`` starts every
row that an index reaches from the reduction's identity, and rows that no index reaches keep ``self``.
``"mean"`` divides by the entry count (plus one with ``include_self``), floor division for integers.

Routed at the dispatcher's CUDA key (:mod:`deepep_lightning.ops._routes`) in deterministic mode:
``index_reduce`` / ``index_reduce_`` / ``index_reduce.out`` ("prod", "mean", "amax", "amin": PyTorch's
CUDA kernel refuses all four), ``scatter_reduce.two`` / ``scatter_reduce_.two`` / ``scatter_reduce.two_out``
("prod"), ``put_`` (``accumulate=True``). ``scatter_reduce``'s other reductions (deterministic in
PyTorch) and every other case run PyTorch's kernel unchanged. An index out of range is a device-side
assert on CUDA (a ``RuntimeError`` on CPU), as in PyTorch's kernels.
"""

import torch
from torch import Tensor

from deepep_lightning.ops._guards import kernels_reason
from deepep_lightning.ops._routes import Route, register_route
from deepep_lightning.ops.scatter import _unsupported_reason, _write_out, segment_scatter_add
from deepep_lightning.ops.segments import (
    INDEX_DTYPES,
    REDUCTION_DTYPES,
    SEGMENT_COMBINE,
    assert_in_range,
    segment_reduce_unchecked,
    sorted_segments,
)

__all__ = ["REDUCTION_DTYPES", "index_reduce", "put_accumulate", "scatter_reduce_prod"]

_INDEX_REDUCTIONS = ("prod", "mean", "amax", "amin")


def _along(flat: Tensor, dim: int, ndim: int) -> Tensor:
    """A ``[size]`` tensor viewed to broadcast along ``dim`` of an ``ndim``-D tensor."""
    shape = [1] * ndim
    shape[dim] = flat.shape[0]
    return flat.view(shape)


def index_reduce(
    self: Tensor, dim: int, index: Tensor, source: Tensor, reduce: str, include_self: bool = True
) -> Tensor:
    """Deterministic ``self.index_reduce(dim, index, source, reduce, include_self=include_self)`` for
    every ``reduce`` (``"prod"``, ``"mean"``, ``"amax"``, ``"amin"``).

    Args:
        self: ``[*outer, size, *inner]`` tensor of one of :data:`REDUCTION_DTYPES`.
        dim: the dimension ``index`` runs along (negative counts from the end).
        index: ``[n]`` int32/int64 rows in ``[0, size)``.
        source: ``[*outer, n, *inner]`` tensor of ``self``'s dtype.
        reduce: ``"prod"``, ``"mean"``, ``"amax"`` or ``"amin"``.
        include_self: combine with ``self`` (default) or start reached rows from the identity.

    Returns:
        A new tensor shaped like ``self``.

    Raises:
        ValueError: ``reduce`` not one of those, or shapes/dtypes that do not fit.

    Example::

        >>> index_reduce(torch.ones(3), 0, torch.tensor([0, 0, 2]), torch.tensor([2.0, 3.0, 4.0]), "prod")
        tensor([6., 1., 4.])
    """
    if reduce not in _INDEX_REDUCTIONS:
        raise ValueError(f"index_reduce: reduce must be one of {_INDEX_REDUCTIONS}, got {reduce!r}")
    if self.dim() == 0 or not -self.dim() <= dim < self.dim():
        raise ValueError(f"index_reduce: dim {dim!r} is not a dimension of self of shape {tuple(self.shape)}")
    dim %= self.dim()
    if index.dim() != 1 or source.dim() != self.dim() or source.shape[dim] != index.shape[0]:
        raise ValueError(
            f"index_reduce: index must be 1-D with one entry per source.shape[{dim}], got index "
            f"{tuple(index.shape)} and source {tuple(source.shape)}"
        )
    if source.dtype != self.dtype:
        raise ValueError(f"index_reduce: source must have self's dtype {self.dtype}, got {source.dtype}")
    size = self.shape[dim]
    if reduce in SEGMENT_COMBINE or kernels_reason(self) is None:
        # one op: sort, segments (and the index's range), reduce from self on; "mean" needs the kernel
        base, values = (self, source) if dim == 0 else (self.movedim(dim, 0), source.movedim(dim, 0))
        reduced, _ = segment_reduce_unchecked(values, index, size, reduce, base, include_self)
        if dim == 0 and self.is_contiguous():
            return reduced
        return torch.empty_like(self).copy_(reduced.movedim(0, dim))  # self's layout, as PyTorch's result
    assert_in_range(index, 0, size, "index_reduce")
    _, _, counts = sorted_segments(index, size)
    base = self if include_self else torch.zeros_like(self)
    if self.is_floating_point():
        sums = segment_scatter_add(source, index, size, dim, base.contiguous())
    else:  # integer sums are exact whatever the order
        sums = base.index_add(dim, index, source)
    divisor = _along(counts + int(include_self), dim, self.dim()).clamp(min=1).to(self.dtype)
    combined = sums / divisor if self.is_floating_point() else torch.div(sums, divisor, rounding_mode="floor")
    return torch.where(_along(counts > 0, dim, self.dim()), combined, self)


def _scatter_positions(self: Tensor, dim: int, index: Tensor) -> Tensor:
    """``[index.numel()]`` row-major flat position in ``self`` of each entry of ``scatter``'s ``index``."""
    sizes = self.shape
    strides = [1] * self.dim()
    for d in range(self.dim() - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    flat = index.to(torch.int64) * strides[dim]
    for d in range(self.dim()):
        if d != dim and index.shape[d] > 1:
            flat = flat + _along(torch.arange(index.shape[d], device=index.device), d, self.dim()) * strides[d]
    return flat.reshape(-1)


def scatter_reduce_prod(self: Tensor, dim: int, index: Tensor, src: Tensor, include_self: bool = True) -> Tensor:
    """Deterministic ``self.scatter_reduce(dim, index, src, "prod", include_self=include_self)``.

    Args:
        self: tensor of one of :data:`REDUCTION_DTYPES`.
        dim: the dimension ``index`` holds positions along (negative counts from the end).
        index: int64 tensor of ``self``'s rank, no larger than ``src`` (nor ``self`` outside ``dim``),
            values in ``[0, self.shape[dim])``.
        src: tensor of ``self``'s dtype and rank.
        include_self: multiply into ``self`` (default) or start reached elements from 1.

    Returns:
        A new tensor shaped like ``self``.

    Raises:
        ValueError: shapes or dtypes that do not fit (named in the message).

    Example::

        >>> scatter_reduce_prod(torch.full((2,), 2.0), 0, torch.tensor([1, 1]), torch.tensor([3.0, 4.0]))
        tensor([ 2., 24.])
    """
    if self.dim() == 0 or index.dim() != self.dim() or src.dim() != self.dim() or not -self.dim() <= dim < self.dim():
        raise ValueError(
            f"scatter_reduce_prod: index and src must have self's rank and dim must be in range, got self "
            f"{tuple(self.shape)}, index {tuple(index.shape)}, src {tuple(src.shape)}, dim {dim!r}"
        )
    dim %= self.dim()
    if any(index.shape[d] > src.shape[d] or (d != dim and index.shape[d] > self.shape[d]) for d in range(self.dim())):
        raise ValueError(
            f"scatter_reduce_prod: index {tuple(index.shape)} must not exceed src {tuple(src.shape)} "
            f"(nor self {tuple(self.shape)} outside dim {dim})"
        )
    if src.dtype != self.dtype:
        raise ValueError(f"scatter_reduce_prod: src must have self's dtype {self.dtype}, got {src.dtype}")
    assert_in_range(index, 0, self.shape[dim], "scatter_reduce")
    values = src[tuple(slice(0, n) for n in index.shape)].reshape(-1)
    positions = _scatter_positions(self, dim, index)
    products, _ = segment_reduce_unchecked(values, positions, self.numel(), "prod", self.reshape(-1), include_self)
    return products.view(self.shape)


def put_accumulate(self: Tensor, index: Tensor, source: Tensor) -> Tensor:
    """Deterministic ``self.clone().put_(index, source, accumulate=True)``: one fixed-order
    :func:`segment_scatter_add` over the flat positions (negative indices count from the end, as in ``put_``).

    Args:
        self: tensor of one of :data:`REDUCTION_DTYPES`.
        index: int64 tensor of flat positions in ``[-self.numel(), self.numel())``.
        source: tensor of ``self``'s dtype with ``index.numel()`` elements.

    Returns:
        A new tensor shaped like ``self``.

    Raises:
        ValueError: ``source`` does not have one element per index, or not ``self``'s dtype.

    Example::

        >>> put_accumulate(torch.zeros(2, 2), torch.tensor([0, -1, 0]), torch.tensor([1.0, 2.0, 3.0]))
        tensor([[4., 0.],
                [0., 2.]])
    """
    if source.numel() != index.numel() or source.dtype != self.dtype:
        raise ValueError(
            f"put_accumulate: source must have self's dtype {self.dtype} and one element per index "
            f"({index.numel()}), got {source.dtype} with {source.numel()}"
        )
    flat_index, values, numel = index.reshape(-1), source.reshape(-1), self.numel()
    assert_in_range(flat_index, -numel, numel, "put_")
    base = self.reshape(-1)
    if values.numel() and self.is_floating_point() and _unsupported_reason(values, flat_index, numel, 0, base) is None:
        # one fixed-order segment sum over the flat positions (negative ones wrapped, as put_ does)
        summed = torch.ops.deepep_lightning.segment_scatter_add.default(
            values, flat_index.remainder(numel), numel, 0, base, 1.0
        )
        return summed.view(self.shape)
    # integers (exact in any order), no extension, or too many entries: PyTorch's index_put_
    return base.clone().index_put_((flat_index,), values, accumulate=True).view(self.shape)


# ---- routes ---------------------------------------------------------------------------------------------


def _device_reason(self: Tensor, *others: Tensor) -> str | None:
    if not isinstance(self, Tensor) or any(not isinstance(o, Tensor) for o in others):
        return "self and the other arguments must be tensors"
    if self.dtype not in REDUCTION_DTYPES or any(o.dtype != self.dtype for o in others[1:]):
        return f"dtype {self.dtype} is not one of {list(REDUCTION_DTYPES)} (or the values' dtype differs)"
    if self.device.type != "cuda" or any(o.device != self.device for o in others):
        return "all tensors must be on self's CUDA device"
    if torch.overrides.has_torch_function(tuple((self, *others))):
        return "tensor subclasses are left to PyTorch"
    return kernels_reason(self)


def _out_reason(self: Tensor, out: Tensor | None) -> str | None:
    if out is not None and (not isinstance(out, Tensor) or out.dtype != self.dtype or out.device != self.device):
        return "out must have self's dtype and device"
    return None


def _index_reduce_covers(self, dim, index, source, reduce, *, include_self=True, out=None) -> str | None:
    if reduce not in _INDEX_REDUCTIONS:
        return f"reduce {reduce!r} is left to PyTorch (only {_INDEX_REDUCTIONS} are routed)"
    reason = _device_reason(self, index, source)
    if reason is not None:
        return reason
    if self.dim() == 0 or not -self.dim() <= dim < self.dim() or index.dim() != 1 or index.dtype not in INDEX_DTYPES:
        return "self must be at least 1-D, dim in range, index 1-D int32/int64"
    dim %= self.dim()
    if source.dim() != self.dim() or source.shape[dim] != index.shape[0]:
        return "source must have self's rank and index.numel() entries along dim"
    if any(source.shape[d] != self.shape[d] for d in range(self.dim()) if d != dim):
        return "source must match self outside dim"
    return _out_reason(self, out)


def _index_reduce(self, dim, index, source, reduce, *, include_self=True):
    return index_reduce(self, dim, index, source, reduce, include_self)


def _index_reduce_inplace(self, dim, index, source, reduce, *, include_self=True):
    return self.copy_(index_reduce(self, dim, index, source, reduce, include_self))


def _index_reduce_out(self, dim, index, source, reduce, *, include_self=True, out):
    return _write_out(out, index_reduce(self, dim, index, source, reduce, include_self))


def _scatter_reduce_covers(self, dim, index, src, reduce, *, include_self=True, out=None) -> str | None:
    if reduce != "prod":
        return f"reduce {reduce!r} is deterministic in PyTorch (only 'prod' is routed)"
    reason = _device_reason(self, index, src)
    if reason is not None:
        return reason
    if index.dtype != torch.int64 or index.dim() != self.dim() or src.dim() != self.dim() or self.dim() == 0:
        return "index must be int64, index and src of self's rank (at least 1-D)"
    if not -self.dim() <= dim < self.dim():
        return f"dim {dim} out of range"
    dim %= self.dim()
    if any(index.shape[d] > src.shape[d] or (d != dim and index.shape[d] > self.shape[d]) for d in range(self.dim())):
        return "index must not exceed src (and self outside dim)"
    return _out_reason(self, out)


def _scatter_reduce(self, dim, index, src, reduce, *, include_self=True):
    return scatter_reduce_prod(self, dim, index, src, include_self)


def _scatter_reduce_inplace(self, dim, index, src, reduce, *, include_self=True):
    return self.copy_(scatter_reduce_prod(self, dim, index, src, include_self))


def _scatter_reduce_out(self, dim, index, src, reduce, *, include_self=True, out):
    return _write_out(out, scatter_reduce_prod(self, dim, index, src, include_self))


def _put_covers(self, index, source, accumulate=False) -> str | None:
    if not accumulate:
        return "accumulate=False is a plain put"
    reason = _device_reason(self, index, source)
    if reason is not None:
        return reason
    if index.dtype != torch.int64 or source.numel() != index.numel():
        return "index must be int64 with one element of source per index (PyTorch raises its own error)"
    return None


def _put(self, index, source, accumulate=False):
    return self.copy_(put_accumulate(self, index, source))


for _route in (
    Route("index_reduce", _index_reduce, _index_reduce_covers),
    Route("index_reduce_", _index_reduce_inplace, _index_reduce_covers),
    Route("index_reduce.out", _index_reduce_out, _index_reduce_covers),
    Route("scatter_reduce.two", _scatter_reduce, _scatter_reduce_covers),
    Route("scatter_reduce_.two", _scatter_reduce_inplace, _scatter_reduce_covers),
    Route("scatter_reduce.two_out", _scatter_reduce_out, _scatter_reduce_covers),
    Route("put_", _put, _put_covers),
):
    register_route(_route)
