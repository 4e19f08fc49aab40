"""Deterministic ``median`` and ``nanmedian`` along a dimension, values and indices.

PyTorch's CUDA ``median(dim)`` refuses ``torch.use_deterministic_algorithms(True)`` ("median CUDA with
indices output") because, when the median value occurs more than once, which of its positions the
index names depends on the selection kernel's scheduling. :func:`median_dim` sorts stably along the
dimension (``torch.sort(stable=True)``) and takes the lower median, the element of rank
``(n - 1) // 2``; with a NaN in the slice the result is NaN, as in PyTorch. The index is fixed by the
stable order:

* distinct values: the index of the median element (PyTorch's, exactly);
* ties: among the equal values, the one of rank ``(n - 1) // 2`` in position order, i.e. the
  ``k``-th occurrence where ``k`` counts the smaller values;
* NaN: the first NaN in position order (as PyTorch's CPU kernel returns).

:func:`nanmedian_dim` ranks only the non-NaN values (the element of rank ``(m - 1) // 2`` of the ``m``
numbers); a slice of NaN alone gives NaN at its first position (PyTorch's CPU kernel names one of the
NaN positions, not always the first).

PyTorch's CPU kernel (``nth_element``) makes no promise among ties; on the cases the tests try it
returns the same positions. The sort is ``O(n log n)`` per slice where PyTorch's selection is linear.

Routed at the dispatcher's CUDA key (:mod:`deepep_lightning.ops._routes`) in deterministic mode:
``median.dim_values`` and ``nanmedian.dim_values``, which the composites ``median.dim`` / ``nanmedian.dim``
(``tensor.median(dim)``) call. A reduced dimension of size 0 raises PyTorch's ``IndexError``.
"""

import torch
from torch import Tensor

from deepep_lightning.ops._routes import Route, register_route

__all__ = ["median_dim", "nanmedian_dim"]

_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
)


def median_dim(self: Tensor, dim: int, keepdim: bool = False) -> tuple[Tensor, Tensor]:
    """Deterministic ``self.median(dim, keepdim)``: ``(values, indices)``.

    Args:
        self: tensor of a real dtype (float16/bfloat16/float32/float64 or integer).
        dim: the dimension to reduce (negative counts from the end; 0 or -1 for a 0-D tensor).
        keepdim: keep ``dim`` with size 1 (default: drop it).

    Returns:
        ``values`` of ``self``'s dtype and ``indices`` (int64) positions along ``dim``.

    Raises:
        IndexError: ``dim`` out of range, or ``self.shape[dim] == 0`` (PyTorch's message).
        ValueError: ``self`` is not of a real dtype that PyTorch's CUDA median takes.

    Example::

        >>> median_dim(torch.tensor([[3.0, 1.0, 1.0, 2.0]]), 1)
        torch.return_types.median(
        values=tensor([1.]),
        indices=tensor([2]))
    """
    values, indices = _median(self, dim, keepdim, ignore_nan=False, op="median")
    return torch.return_types.median((values, indices))


def nanmedian_dim(self: Tensor, dim: int, keepdim: bool = False) -> tuple[Tensor, Tensor]:
    """Deterministic ``self.nanmedian(dim, keepdim)``: the lower median of the non-NaN values.

    Args, returns and raises as :func:`median_dim`.

    Example::

        >>> nanmedian_dim(torch.tensor([[3.0, float("nan"), 1.0]]), 1)
        torch.return_types.nanmedian(
        values=tensor([1.]),
        indices=tensor([2]))
    """
    values, indices = _median(self, dim, keepdim, ignore_nan=True, op="nanmedian")
    return torch.return_types.nanmedian((values, indices))


def _median(self: Tensor, dim: int, keepdim: bool, ignore_nan: bool, op: str) -> tuple[Tensor, Tensor]:
    if self.dtype not in _DTYPES:
        raise ValueError(f"{op}_dim: self must be one of {list(_DTYPES)}, got {self.dtype}")
    ndim = max(self.dim(), 1)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise IndexError(f"{op}_dim: dim must be in [{-ndim}, {ndim}), got {dim!r}")
    dim %= ndim
    if self.dim() == 0:
        return self.clone(), torch.zeros((), dtype=torch.int64, device=self.device)
    n = self.shape[dim]
    if n == 0:
        raise IndexError(f"{op}(): Expected reduction dim {dim} to have non-zero size.")
    values, order = torch.sort(self, dim=dim, stable=True)  # NaN sorts last, in position order
    shape = list(self.shape)
    shape[dim] = 1
    rank = torch.full(shape, (n - 1) // 2, dtype=torch.int64, device=self.device)
    if self.is_floating_point():
        nans = torch.isnan(self).sum(dim, keepdim=True)
        if ignore_nan:  # rank among the non-NaN values; all NaN: the first NaN
            rank = torch.div(n - nans - 1, 2, rounding_mode="floor").clamp(min=0)
        else:  # any NaN: the first NaN
            rank = torch.where(nans > 0, n - nans, rank)
    median_values, median_indices = values.gather(dim, rank), order.gather(dim, rank)
    if not keepdim:
        median_values, median_indices = median_values.squeeze(dim), median_indices.squeeze(dim)
    return median_values, median_indices


# ---- route ----------------------------------------------------------------------------------------------


def _covers(self, dim, keepdim=False, *, values, indices) -> str | None:
    if not isinstance(self, Tensor) or self.dtype not in _DTYPES:
        return f"self must be a tensor of one of {list(_DTYPES)}"
    if self.device.type != "cuda" or values.device != self.device or indices.device != self.device:
        return "self, values and indices must be on one CUDA device"
    if values.dtype != self.dtype or indices.dtype != torch.int64:
        return "values must have self's dtype and indices int64 (PyTorch raises its own error)"
    if torch.overrides.has_torch_function((self, values, indices)):
        return "tensor subclasses are left to PyTorch"
    return None


def _write(values: Tensor, indices: Tensor, result: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    for out, computed in zip((values, indices), result):
        if tuple(out.shape) != tuple(computed.shape):
            out.resize_(computed.shape)
        out.copy_(computed)
    return values, indices


def _route(self, dim, keepdim=False, *, values, indices):
    return _write(values, indices, _median(self, dim, keepdim, ignore_nan=False, op="median"))


def _nan_route(self, dim, keepdim=False, *, values, indices):
    return _write(values, indices, _median(self, dim, keepdim, ignore_nan=True, op="nanmedian"))


register_route(Route("median.dim_values", _route, _covers))
register_route(Route("nanmedian.dim_values", _nan_route, _covers))
