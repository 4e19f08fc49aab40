"""Run a computation N times and compare the repeats bitwise: the core of L1, L2 and L3."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from deepep_lightning.audit.hashing import bitwise_equal, hashes_to_ints, iter_named_tensors, max_abs_diff, tensor_hash

__all__ = ["RepeatStats", "run_repeats"]

_MAX_LISTED = 20


@dataclasses.dataclass
class RepeatStats:
    """What N repeats of one computation gave.

    Attributes:
        repeats: how many ran.
        reproducible: every repeat bitwise equal to the first (dtype, shape and bytes of every tensor).
        distinct_results: number of different results among the repeats (1 when reproducible).
        max_abs_diff: largest |difference| from the first repeat over all tensors (0.0 when reproducible).
        differing: names of the tensors that differed in some repeat (at most 20 listed).
        tensors: number of tensors compared per repeat.
        seconds: wall time of all repeats (including hashing).
    """

    repeats: int
    reproducible: bool
    distinct_results: int
    max_abs_diff: float
    differing: list
    tensors: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _named(result: Any) -> dict[str, Tensor]:
    return {name: tensor.detach() for name, tensor in iter_named_tensors(result)}


def run_repeats(
    compute: Callable[[], Any],
    repeats: int = 100,
    reset: Callable[[], None] | None = None,
) -> RepeatStats:
    """Call ``compute()`` ``repeats`` times (``reset()`` before each) and compare bitwise with the first.

    Args:
        compute: returns a tensor or a nested structure of tensors (dict/list/tuple/dataclass).
        repeats: number of calls, >= 2.
        reset: restores whatever the computation must start from (RNG states, weights).

    Raises:
        ValueError: ``repeats`` < 2, or ``compute`` returned no tensor.

    Example::

        x = torch.randn(1000)
        stats = run_repeats(lambda: x.cumsum(0), repeats=10)
        assert stats.reproducible
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
        raise ValueError(f"`repeats` must be an int >= 2, got {repeats!r}")
    start = time.perf_counter()
    first: dict[str, Tensor] | None = None
    hashes: list[list[Tensor]] = []
    differing: dict[str, float] = {}
    for _ in range(repeats):
        if reset is not None:
            reset()
        result = _named(compute())
        if not result:
            raise ValueError("`compute` returned no tensor; return the outputs (and gradients) to compare")
        hashes.append([tensor_hash(t) for t in result.values()])
        if first is None:
            first = {name: t.clone() for name, t in result.items()}
            continue
        if list(result) != list(first):
            raise ValueError(f"`compute` returned different names across repeats: {list(first)} vs {list(result)}")
        for name, tensor in result.items():
            if not bitwise_equal(first[name], tensor):
                diff = max_abs_diff(first[name], tensor)
                differing[name] = max(differing.get(name, 0.0), float("inf") if diff is None else diff)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert first is not None
    rows = [tuple(hashes_to_ints(row)) for row in hashes]
    return RepeatStats(
        repeats=repeats,
        reproducible=not differing,
        distinct_results=max(2, len(set(rows))) if differing else 1,
        max_abs_diff=max(differing.values(), default=0.0),
        differing=sorted(differing, key=lambda n: -differing[n])[:_MAX_LISTED],
        tensors=len(first),
        seconds=seconds,
    )
