"""Deterministic ``bincount`` with weights and floating-point ``histc``.

PyTorch's CUDA ``_bincount_cuda`` (with weights) and ``_histc_cuda`` (floating input) count with float
``atomicAdd`` and refuse ``torch.use_deterministic_algorithms(True)``. Here:

* :func:`bincount` sums the weights of each value with one sorted, fixed-order
  :func:`~deepep_lightning.ops.scatter.segment_scatter_add`; the output dtype is PyTorch's (float32
  weights give float32, any other weights float64; an empty input gives int64 zeros of ``minlength``).
* :func:`histc` computes each value's bin with PyTorch's arithmetic (``int((x - min) * bins / (max - min))``
  in the accumulate type: float32 for float16/bfloat16/float32, float64 for float64), puts ``max`` in the
  last bin, ignores values outside ``[min, max]`` (and NaN), and counts the bins in int64 with
  ``torch.ops.deepep_lightning.histc_counts`` (``extensions/csrc/histc_counts.cpp``; on CUDA one kernel whose integer
  atomics are exact in any order, where PyTorch's adds floats); the counts are cast to the input's dtype.
  :func:`histc_counts_reference` counts the same bins with a sort and binary searches (the fallback
  without the extension and the tests' oracle).

Both read values on the host where PyTorch does too: ``bincount``'s output length is ``max(input) + 1``,
and ``histc`` with ``min == max`` takes the data's range. Those calls synchronise (and cannot be captured
in a CUDA graph), as PyTorch's own kernels do.

Routed at the dispatcher's CUDA key (:mod:`deepep_lightning.ops._routes`) in deterministic mode:
``bincount`` with weights, ``histc`` / ``histc.out`` for floating inputs. ``bincount`` without weights
and integer ``histc`` count with integer atomics (exact in any order) and run PyTorch's kernel unchanged.
"""

import math

import torch
from torch import Tensor

from deepep_lightning.ops._guards import FLOAT_DTYPES, kernels_reason, register_fakes
from deepep_lightning.ops._routes import Route, register_route
from deepep_lightning.ops.scatter import _write_out, segment_scatter_add
from deepep_lightning.ops.segments import sorted_segments

__all__ = ["bincount", "histc", "histc_counts_reference"]

_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_BINCOUNT_ERROR = "bincount only supports 1-d non-negative integral inputs."


def bincount(self: Tensor, weights: Tensor, minlength: int = 0) -> Tensor:
    """Deterministic ``torch.bincount(self, weights=weights, minlength=minlength)``.

    Args:
        self: 1-D non-negative integer tensor.
        weights: 1-D tensor of ``self``'s length (any real dtype).
        minlength: the least output length (default 0).

    Returns:
        ``[max(max(self) + 1, minlength)]`` sums of the weights per value: float32 for float32 weights,
        float64 otherwise; int64 zeros of ``minlength`` when ``self`` is empty (as PyTorch).

    Raises:
        RuntimeError: ``self`` is not 1-D integral or holds a negative value, ``weights`` does not match
            it (PyTorch's messages).
        ValueError: ``minlength`` is negative.

    Example::

        >>> bincount(torch.tensor([0, 2, 2]), torch.tensor([0.5, 1.0, 2.0]))
        tensor([0.5000, 0.0000, 3.0000])
    """
    if isinstance(minlength, bool) or not isinstance(minlength, int) or minlength < 0:
        raise ValueError(f"bincount: minlength must be an int >= 0, got {minlength!r}")
    if self.dim() != 1 or self.dtype not in _INTEGER_DTYPES:
        raise RuntimeError(_BINCOUNT_ERROR)
    if weights.dim() != 1 or weights.shape[0] != self.shape[0] or weights.device != self.device:
        raise RuntimeError(
            f"bincount: weights must be 1-D of self's length {self.shape[0]} on {self.device}, "
            f"got {tuple(weights.shape)} on {weights.device}"
        )
    if self.numel() == 0:
        return torch.zeros(minlength, dtype=torch.int64, device=self.device)
    low, high = (int(v) for v in torch.stack([self.min(), self.max()]).tolist())  # host sync, as PyTorch
    if low < 0:
        raise RuntimeError(_BINCOUNT_ERROR)
    dtype = torch.float32 if weights.dtype == torch.float32 else torch.float64
    return segment_scatter_add(weights.to(dtype), self.to(torch.int64), max(high + 1, minlength))


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def histc(self: Tensor, bins: int = 100, min: float = 0, max: float = 0) -> Tensor:  # noqa: A002 - aten names
    """Deterministic ``torch.histc(self, bins, min, max)`` for a floating ``self``.

    Args:
        self: floating tensor (float16/bfloat16/float32/float64), any shape.
        bins: number of equal-width bins over ``[min, max]`` (default 100).
        min: lower end (default 0); with ``min == max`` the data's minimum and maximum are used (and
            widened by 1 on each side when they are equal, as PyTorch does).
        max: upper end, inclusive: a value equal to ``max`` goes in the last bin.

    Returns:
        ``[bins]`` counts in ``self``'s dtype; values outside ``[min, max]`` and NaN are not counted.

    Raises:
        RuntimeError: ``bins`` not positive, ``min > max``, or a range that is not finite (PyTorch's
            messages).
        ValueError: ``self`` is not floating point.

    Example::

        >>> histc(torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 9.0]), bins=4, min=0, max=4)
        tensor([1., 1., 1., 2.])
    """
    if not self.is_floating_point() or self.dtype not in FLOAT_DTYPES:
        raise ValueError(f"histc: self must be one of {list(FLOAT_DTYPES)}, got {self.dtype}")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins <= 0:
        raise RuntimeError(f"torch.histc: bins must be > 0, but got {bins!r}")
    low, high = (torch.tensor(float(v), dtype=self.dtype).item() for v in (min, max))  # rounded as PyTorch
    if low > high:
        raise RuntimeError("torch.histc: max must be larger than min")
    if low == high and self.numel() > 0:
        low, high = torch.stack([self.min(), self.max()]).tolist()  # host sync, as PyTorch
    if low == high:
        low, high = low - 1, high + 1
    if not (math.isfinite(low) and math.isfinite(high)):
        raise RuntimeError(f"torch.histc: range of [{low:g}, {high:g}] is not finite")
    if kernels_reason(self) is not None:
        return histc_counts_reference(self, bins, low, high).to(self.dtype)
    return torch.ops.deepep_lightning.histc_counts.default(self, bins, float(low), float(high)).to(self.dtype)


def histc_counts_reference(self: Tensor, bins: int, low: float, high: float) -> Tensor:
    """``[bins]`` int64 counts of ``self``'s values in ``bins`` equal bins over ``[low, high]`` (finite,
    ``low < high``), PyTorch's bin arithmetic; values outside and NaN are not counted. Pure PyTorch: the
    bins are counted with a sort and binary searches."""
    accumulate = _accumulate_dtype(self.dtype)
    values = self.reshape(-1).to(accumulate)
    lo = torch.tensor(low, dtype=accumulate, device=self.device)
    hi = torch.tensor(high, dtype=accumulate, device=self.device)
    inside = (values >= lo) & (values <= hi)
    position = ((values - lo) * bins / (hi - lo)).nan_to_num(0.0).clamp(0, bins).to(torch.int64)
    keys = torch.where(inside, position.clamp(max=bins - 1), bins)  # bin `bins` collects what is not counted
    _, _, counts = sorted_segments(keys, bins + 1)
    return counts[:bins]


def _histc_counts_fake(self: Tensor, bins: int, low: float, high: float) -> Tensor:
    return self.new_empty((bins,), dtype=torch.int64)


register_fakes({"deepep_lightning::histc_counts": _histc_counts_fake})


# ---- routes ---------------------------------------------------------------------------------------------


def _bincount_covers(self, weights=None, minlength=0) -> str | None:
    if weights is None:
        return "bincount without weights counts with integer atomics (deterministic in PyTorch)"
    if not isinstance(self, Tensor) or not isinstance(weights, Tensor):
        return "self and weights must be tensors"
    if self.device.type != "cuda" or weights.device != self.device:
        return "self and weights must be on one CUDA device"
    if self.dim() != 1 or self.dtype not in _INTEGER_DTYPES or weights.dim() != 1 or weights.shape != self.shape:
        return "self must be 1-D integral and weights 1-D of its length (PyTorch raises its own error)"
    if weights.dtype.is_complex or weights.dtype == torch.bool:
        return f"weights dtype {weights.dtype} is left to PyTorch"
    if torch.overrides.has_torch_function((self, weights)):
        return "tensor subclasses are left to PyTorch"
    return kernels_reason(self)


def _histc_covers(self, bins=100, min=0, max=0, *, out=None) -> str | None:  # noqa: A002
    if not isinstance(self, Tensor) or self.dtype not in FLOAT_DTYPES:
        return "integer histc counts with integer atomics (deterministic in PyTorch)"
    if self.device.type != "cuda":
        return "self must be a CUDA tensor"
    if out is not None and (not isinstance(out, Tensor) or out.dtype != self.dtype or out.device != self.device):
        return "out must have self's dtype and device"
    if torch.overrides.has_torch_function((self,)):
        return "tensor subclasses are left to PyTorch"
    return None


def _bincount(self, weights=None, minlength=0):
    return bincount(self, weights, minlength)


def _histc(self, bins=100, min=0, max=0):  # noqa: A002
    return histc(self, bins, min, max)


def _histc_out(self, bins=100, min=0, max=0, *, out):  # noqa: A002
    return _write_out(out, histc(self, bins, min, max))


for _route in (
    Route("bincount", _bincount, _bincount_covers),
    Route("histc", _histc, _histc_covers),
    Route("histc.out", _histc_out, _histc_covers),
):
    register_route(_route)
