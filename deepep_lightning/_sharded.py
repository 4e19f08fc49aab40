"""Sharded tensors (``DTensor``: FSDP2's ``fully_shard``, tensor parallel) seen as this rank's local shard.

A ``DTensor`` runs every op as a distributed op: a reduction over it is a collective, and an
in-place copy from a plain tensor is refused. Health checks and snapshots work on what a rank owns:
the local shard (:func:`local`), whose copy and restore are plain tensor operations that keep the
``DTensor`` (its placements, its device mesh, its identity) as it is.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor

__all__: list[str] = []


def local(tensor: Tensor) -> Tensor:
    """The local shard of a ``DTensor`` (a view sharing its storage); any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
