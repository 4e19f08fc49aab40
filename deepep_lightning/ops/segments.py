"""Reductions over the entries that share a key: ``deepep_lightning::segment_reduce``.

:func:`segment_reduce` combines each key's entries with one ``torch.ops.deepep_lightning.segment_reduce`` call
(``extensions/csrc/segment_reduce.cpp``, CUDA kernels in ``extensions/csrc/cuda/segment_reduce.cu``): a stable
sort of the keys, a binary search per output row for its entries (which also checks the keys' range), and
one thread per output element that reduces left to right in entry order, so it is bitwise reproducible and
its order is that of PyTorch's sequential CPU kernels. An optional ``base`` is combined in the same launch
(``index_reduce``'s ``include_self``). :func:`segment_reduce_reference` is the same reduction in pure
PyTorch (a segmented inclusive scan: the fallback without the extension and the tests' oracle); its
products pair the operands in another fixed order, so they agree with the kernel's to rounding (integers,
maxima and minima exactly). :func:`sorted_segments` is the sort and the binary searches in PyTorch ops.
"""

import math

import torch
from torch import Tensor

from deepep_lightning.ops._guards import FLOAT_DTYPES, kernels_reason, register_fakes

__all__ = [
    "REDUCTION_DTYPES",
    "segment_reduce",
    "segment_reduce_reference",
    "segment_reduce_unchecked",
    "sorted_segments",
]

#: Dtypes the reductions take: PyTorch's CUDA ``index_reduce``/``scatter_reduce`` dtypes without bool.
REDUCTION_DTYPES = (*FLOAT_DTYPES, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
INDEX_DTYPES = (torch.int64, torch.int32)
SEGMENT_COMBINE = {"prod": torch.mul, "amax": torch.maximum, "amin": torch.minimum}


def assert_in_range(index: Tensor, low: int, high: int, op: str) -> None:
    """Device-side assert (no host sync on CUDA; raises at once on CPU) that ``low <= index < high``."""
    if index.numel():
        torch._assert_async(((index >= low) & (index < high)).all(), f"{op}: index out of range [{low}, {high})")


def sorted_segments(keys: Tensor, size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Stable sort of ``keys`` (``[n]`` in ``[0, size)``) and each key's segment: ``(order, starts, counts)``.

    ``order`` ([n]) permutes the entries into key order, entry order kept within a key; ``starts`` and
    ``counts`` ([size], int64) locate key ``r``'s entries in that order. Sort and binary searches only: exact
    and reproducible, no host sync.
    """
    sorted_keys, order = torch.sort(keys.to(torch.int64), stable=True)
    rows = torch.arange(size, device=keys.device, dtype=torch.int64)
    starts = torch.searchsorted(sorted_keys, rows)
    ends = torch.searchsorted(sorted_keys, rows, right=True)
    return order, starts, ends - starts


def _check(values: Tensor, keys: Tensor, reduce: str) -> None:
    if reduce not in SEGMENT_COMBINE:
        raise ValueError(f"segment_reduce: reduce must be one of {tuple(SEGMENT_COMBINE)}, got {reduce!r}")
    if values.dim() == 0 or keys.dim() != 1 or keys.shape[0] != values.shape[0] or keys.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"segment_reduce: keys must be 1-D int32/int64 with one key per row of values, got keys "
            f"{keys.dtype} {tuple(keys.shape)} for values {tuple(values.shape)}"
        )
    if values.dtype not in REDUCTION_DTYPES or keys.device != values.device:
        raise ValueError(
            f"segment_reduce: values must be one of {list(REDUCTION_DTYPES)} on keys' device {keys.device}, "
            f"got {values.dtype} on {values.device}"
        )


def segment_reduce(values: Tensor, keys: Tensor, size: int, reduce: str = "prod") -> tuple[Tensor, Tensor]:
    """Reduce the rows of ``values`` that share a key: ``out[r] = reduce(values[i] for keys[i] == r)``.

    Runs the compiled kernel when the extension is available for ``values``' device, otherwise
    :func:`segment_reduce_reference`.

    Args:
        values: ``[n, *inner]`` tensor of one of :data:`REDUCTION_DTYPES`.
        keys: ``[n]`` int32/int64 keys in ``[0, size)`` (checked: on CPU an error, on CUDA a device assert).
        size: number of output rows.
        reduce: ``"prod"`` (default), ``"amax"`` or ``"amin"`` (NaN propagates, as ``torch.maximum``).

    Returns:
        ``(reduced, counts)``: ``reduced`` ``[size, *inner]`` (1 for ``"prod"``, 0 otherwise where a key has
        no entry), ``counts`` ``[size]`` int64 entries per key. Bitwise reproducible.

    Raises:
        ValueError: ``reduce`` unknown, or ``values``/``keys`` shapes, dtypes or devices that do not fit.

    Example::

        >>> segment_reduce(torch.tensor([2.0, 3.0, 5.0]), torch.tensor([1, 0, 1]), 3)[0]
        tensor([ 3., 10.,  1.])
    """
    _check(values, keys, reduce)
    return segment_reduce_unchecked(values, keys, size, reduce)


def segment_reduce_unchecked(
    values: Tensor, keys: Tensor, size: int, reduce: str, base: Tensor | None = None, include_base: bool = True
) -> tuple[Tensor, Tensor]:
    """:func:`segment_reduce` for a caller that has checked the arguments, with an optional ``base``
    (``[size, *inner]``, ``values``' dtype): rows with entries become ``combine(base[r], reduced[r])`` (with
    ``include_base``) or ``reduced[r]``, rows without entries ``base[r]``. The keys' range is checked here."""
    inner = values.shape[1:]
    if kernels_reason(values) is not None:  # the reference: prod/amax/amin (index_reduce's mean has its own)
        reduced, counts = segment_reduce_reference(values, keys, size, reduce)
        if base is None:
            return reduced, counts
        hit = (counts > 0).view((size,) + (1,) * len(inner))
        combined = SEGMENT_COMBINE[reduce](base, reduced) if include_base else reduced
        return torch.where(hit, combined, base), counts
    flat = values.reshape(values.shape[0], math.prod(inner))
    flat_base = None if base is None else base.reshape(size, flat.shape[1])
    reduced, counts = torch.ops.deepep_lightning.segment_reduce.default(
        flat, keys, size, reduce, flat_base, include_base
    )
    return reduced.view(size, *inner), counts


def segment_reduce_reference(values: Tensor, keys: Tensor, size: int, reduce: str = "prod") -> tuple[Tensor, Tensor]:
    """:func:`segment_reduce` in pure PyTorch: a segmented inclusive scan over the key-sorted entries
    (Hillis-Steele: ``ceil(log2(n))`` elementwise steps with a fixed pairing), then each segment's last
    element. Same arguments and results (products to rounding)."""
    _check(values, keys, reduce)
    assert_in_range(keys, 0, size, "segment_reduce")
    combine = SEGMENT_COMBINE[reduce]
    order, starts, counts = sorted_segments(keys, size)
    empty = torch.full((size, *values.shape[1:]), int(reduce == "prod"), dtype=values.dtype, device=values.device)
    n = values.shape[0]
    if n == 0:
        return empty, counts
    scan = values.index_select(0, order)  # [n, *inner] in key order
    sorted_keys = keys.to(torch.int64).index_select(0, order)
    step = 1
    while step < n:  # after this step, scan[i] reduces its segment's entries in (i - 2 * step, i]
        same = (sorted_keys[step:] == sorted_keys[:-step]).view((n - step,) + (1,) * (values.dim() - 1))
        scan = torch.cat([scan[:step], torch.where(same, combine(scan[:-step], scan[step:]), scan[step:])])
        step *= 2
    last = (starts + counts - 1).clamp(min=0)
    hit = (counts > 0).view((size,) + (1,) * (values.dim() - 1))
    return torch.where(hit, scan.index_select(0, last), empty), counts


def _segment_reduce_fake(
    values: Tensor, keys: Tensor, size: int, reduce: str, base: Tensor | None = None, include_base: bool = True
) -> tuple[Tensor, Tensor]:
    torch._check(
        values.dim() == 2, lambda: f"deepep_lightning::segment_reduce: values must be 2-D, got {values.dim()}-D"
    )
    return values.new_empty((size, values.shape[1])), keys.new_empty((size,), dtype=torch.int64)


register_fakes({"deepep_lightning::segment_reduce": _segment_reduce_fake})
