"""Sort each scatter index once while it is alive and unchanged: :func:`segment_sort_plan` and :class:`SortPlanCache`.

A graph network scatters along the same ``edge_index`` row in every layer: forward (``scatter_add_`` of the
messages into their targets) and backward (``index_add_``, the gradient of ``x.index_select(0, source)``).
:func:`~deepep_lightning.ops.scatter.segment_scatter_add` sorts its index on every call; on a small graph
that sort is most of the op (a key kernel, cub's radix sort with its memset, a search per row: five to six
launches and their host time against the one or two that sum). The plan of a sort depends on the index's
values and the row count alone, so the routed ``index_add_`` / ``scatter_add_`` calls ask this cache for it.

A plan is reused only while all of these hold, checked on every call from metadata alone (no device read,
no synchronisation):

* the tensor the index is a view of (its ``_base``, or itself) is alive: a weak reference, whose callback
  drops the plan when it is freed, so new memory at the same address never meets an old plan (a route that
  takes a view of its argument below autograd, where views record no base, names the argument: ``view_of``);
* the index's address, shape, strides and dtype, the row count and the current CUDA stream are those the
  plan was made for;
* the index's version counter (shared by every view of one tensor) has not moved: any in-place write
  through any view (``copy_``, ``index_fill_``, a ``DataLoader``'s ``non_blocking`` copy into it) makes a
  new plan.

What the version counter cannot see is a write through ``Tensor.data`` (which has its own counter) or
through memory shared outside PyTorch (DLPack, a raw pointer). An index written so must not be scattered
along through the routes with the cache on: :meth:`SortPlanCache.clear` drops every plan, and
``SortPlanCache.enabled = False`` (``deepep_lightning.ops.sort_plans.SORT_PLANS.enabled``) stops caching.

Nothing is cached or read while a CUDA graph is being captured (a replay would keep the captured plan
whatever its index holds then), for inference tensors (no version counter) or for tensor subclasses.
"""

import collections
import weakref
from typing import NamedTuple

import torch
from torch import Tensor

from deepep_lightning.ops.extension_loader import cuda_kernels_available, extension_available, on_extension_loaded
from deepep_lightning.ops.segments import INDEX_DTYPES

__all__ = [
    "MAX_PLAN_LENGTH",
    "SORT_PLANS",
    "SortPlanCache",
    "is_plan_for",
    "segment_sort_plan",
    "segment_sort_plan_reference",
]

#: The largest row count and index length a plan holds (it is int32).
MAX_PLAN_LENGTH = 2**31 - 2


def segment_sort_plan_reference(index: Tensor, size: int) -> Tensor:
    """The pure-PyTorch definition of :func:`segment_sort_plan`: stable sort, entry ids, each row's first position."""
    keys = index.to(torch.int64)
    sorted_keys, order = torch.sort(keys, stable=True)
    starts = torch.searchsorted(sorted_keys, torch.arange(size + 1, device=index.device))
    return torch.cat([sorted_keys, order, starts]).to(torch.int32)


def segment_sort_plan(index: Tensor, size: int) -> Tensor:
    """The sort of ``index`` that :func:`~deepep_lightning.ops.scatter.segment_scatter_add` sums in (its ``plan``).

    A plan depends on ``index`` and ``size`` alone. A caller that scatters along one index several times (a
    graph network's layers, forward and backward, along one ``edge_index`` row) sorts it once:
    :class:`SortPlanCache` keeps the plans of the routed ``index_add_`` /
    ``scatter_add_`` calls. A plan must be used only while ``index`` holds the values it was made from: a stale
    plan sums the wrong entries.

    Args:
        index: ``[n]`` int64/int32 rows in ``[0, size)`` (out of range: a device-side assert on CUDA).
        size: number of rows, ``0 <= size < 2**31 - 1``.

    Returns:
        int32 ``[2 n + size + 1]`` on ``index``'s device: the keys in ascending order (stable), the entry ids in
        that order, then for each row ``r`` in ``[0, size]`` the first sorted position whose key is ``>= r``.

    Raises:
        TypeError: ``index`` is not a tensor or ``size`` not an int.
        ValueError: ``index`` is not 1-D int64/int32 on the CPU or a CUDA device, or ``size`` is out of range.

    Example::

        >>> segment_sort_plan(torch.tensor([2, 0, 2]), 3).tolist()
        [0, 2, 2, 1, 0, 2, 0, 1, 1, 3]
    """
    if not isinstance(index, Tensor):
        raise TypeError(f"segment_sort_plan: index must be a tensor, got {type(index)!r}")
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"segment_sort_plan: size must be an int, got {size!r}")
    if not 0 <= size <= MAX_PLAN_LENGTH:
        raise ValueError(f"segment_sort_plan: size must be in [0, {MAX_PLAN_LENGTH}], got {size}")
    if index.dim() != 1 or index.dtype not in INDEX_DTYPES or index.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"segment_sort_plan: index must be 1-D int64/int32 on the CPU or a CUDA device, got {index.dtype} of "
            f"shape {tuple(index.shape)} on {index.device}"
        )
    if index.shape[0] > MAX_PLAN_LENGTH:
        raise ValueError(f"segment_sort_plan: index has {index.shape[0]} entries, more than {MAX_PLAN_LENGTH}")
    if not extension_available() or (index.is_cuda and not cuda_kernels_available()):
        return segment_sort_plan_reference(index, size)
    if not index.is_cuda and index.numel() and not (0 <= int(index.min()) and int(index.max()) < size):
        raise ValueError(f"segment_sort_plan: index must lie in [0, {size})")
    return torch.ops.deepep_lightning.segment_sort_plan.default(index, size)


def is_plan_for(plan: object, index: Tensor, size: int) -> bool:
    """Whether ``plan`` has the shape, dtype, layout and device of ``segment_sort_plan(index, size)``."""
    return (
        isinstance(plan, Tensor)
        and plan.dtype == torch.int32
        and plan.device == index.device
        and plan.dim() == 1
        and plan.shape[0] == 2 * index.shape[0] + size + 1
        and plan.is_contiguous()
    )


def _plan_fake(index: Tensor, size: int) -> Tensor:
    return index.new_empty(2 * index.shape[0] + size + 1, dtype=torch.int32)


on_extension_loaded(lambda: torch.library.register_fake("deepep_lightning::segment_sort_plan")(_plan_fake))


class _Key(NamedTuple):
    root: int  # id() of the tensor the index views
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    size: int
    device: int
    stream: int


class _Entry(NamedTuple):
    root: weakref.ref
    version: int
    plan: Tensor


class SortPlanCache:
    """The sort plans of live, unchanged CUDA index tensors, at most ``capacity`` of them (least recent out).

    Args:
        capacity: how many plans to keep (``>= 1``).
        device_type: the device whose indices it keeps plans for: ``"cuda"`` (the routes), or ``"cpu"``, where
            the plan is not needed to sum and only the cache's own logic is exercised (tests).

    Raises:
        ValueError: ``capacity`` is not an int ``>= 1`` or ``device_type`` not ``"cuda"``/``"cpu"``.

    Example::

        >>> cache = SortPlanCache()
        >>> cache.plan(torch.tensor([1, 0]), 2) is None  # a CPU index: the routes sum on CUDA only
        True
    """

    def __init__(self, capacity: int = 64, device_type: str = "cuda") -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"SortPlanCache: capacity must be an int >= 1, got {capacity!r}")
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"SortPlanCache: device_type must be 'cuda' or 'cpu', got {device_type!r}")
        self.capacity = capacity
        self.device_type = device_type
        self.enabled = True
        self.sorts = 0  # plans made (a miss), for tests and benchmarks
        self._entries: collections.OrderedDict[_Key, _Entry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every plan."""
        self._entries.clear()

    def plan(self, index: Tensor, size: int, view_of: Tensor | None = None) -> Tensor | None:
        """``segment_sort_plan(index, size)``, made once while ``index`` is alive and unchanged; None to sort inline.

        ``view_of``: the tensor ``index`` was taken from, where ``index`` was made below autograd (inside a routed
        op's kernel), where a view records neither its base nor its base's version counter: the liveness and the
        version are then read from ``view_of``. ``index`` must lie within ``view_of``'s memory.

        None where nothing may be cached: an index on another device type, caching off, CUDA-graph capture, an
        inference tensor, a tensor subclass, a row count or length beyond a plan's int32, no CUDA kernels.
        ``index`` is a 1-D int64/int32 tensor whose values lie in ``[0, size)`` (checked on the device, as the
        scatter does).
        """
        if not self.enabled or index.device.type != self.device_type or type(index) is not Tensor:
            return None
        if index.is_inference() or size > MAX_PLAN_LENGTH or index.shape[0] > MAX_PLAN_LENGTH:
            return None
        device = index.device.index
        if index.is_cuda:
            if torch.cuda.is_current_stream_capturing() or not cuda_kernels_available():
                return None
            stream = torch._C._cuda_getCurrentRawStream(device)
        else:
            stream = 0
        anchor = index if view_of is None else view_of
        root = anchor._base if anchor._base is not None else anchor
        key = _Key(
            id(root),
            index.data_ptr(),
            tuple(index.shape),
            index.stride(),
            index.dtype,
            size,
            -1 if device is None else device,
            stream,
        )
        version = anchor._version
        entry = self._entries.get(key)
        if entry is not None and entry.version == version and entry.root() is root:
            self._entries.move_to_end(key)
            return entry.plan
        plan = torch.ops.deepep_lightning.segment_sort_plan.default(index, size)
        self.sorts += 1
        self._entries[key] = _Entry(weakref.ref(root, self._forget(key)), version, plan)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return plan

    def _forget(self, key: _Key):
        """The weak reference's callback: drop ``key``'s plan when its root tensor is freed."""
        entries = weakref.ref(self._entries)

        def forget(_reference: weakref.ref) -> None:
            live = entries()
            if live is not None:
                live.pop(key, None)

        return forget


#: The process's cache, used by the ``index_add`` / ``scatter_add`` routes (:mod:`deepep_lightning.ops.scatter`).
SORT_PLANS = SortPlanCache()
