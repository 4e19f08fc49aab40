"""What a sharded run (FSDP2, tensor parallel) records for an exact resume: layout, every rank's RNG.

Under Lightning's ``ModelParallelStrategy`` a checkpoint is a directory written by
``torch.distributed.checkpoint``: every rank writes its shards of the weights and optimizer state,
and rank 0 alone writes the rest (loops, callback states) to one metadata file. DeterminismCallback
therefore gathers every rank's RNG states into its own state at save (:func:`gather_per_rank`; every
rank saves, so the gather is collective) and each rank takes its own at resume (:func:`own_rank_value`).

The data order and the per-batch RNG streams follow the **data-parallel** position of a rank
(:func:`data_parallel_position`): the ranks of one tensor-parallel group compute on the same batch
with the same random numbers, as the replicated activations of tensor parallelism require.

The device mesh (``data_parallel`` x ``tensor_parallel`` sizes) is recorded, and a resume on another
mesh is refused naming both (:func:`check_mesh_layout`): ``torch.distributed.checkpoint`` could
reshard the weights, but the data shards, the per-rank streams and the gradient reduce-scatter are
functions of the mesh, so the resumed run would not continue the same run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = [
    "ShardingLayoutMismatchError",
    "check_mesh_layout",
    "data_parallel_position",
    "describe_mesh",
    "gather_per_rank",
    "mesh_layout",
    "own_rank_value",
]


class ShardingLayoutMismatchError(MisconfigurationException):
    """A checkpoint written on one device mesh (world size, data/tensor-parallel sizes) resumed on another."""


def data_parallel_position(trainer: pl.Trainer) -> tuple[int, int]:
    """``(rank, size)`` of this process among the data-parallel replicas (the strategy's sampler arguments).

    Plain DDP: the global rank and the world size; ``ModelParallelStrategy``: the rank in the
    ``data_parallel`` mesh dimension and its size; one process: ``(0, 1)``.
    """
    try:
        kwargs = trainer.strategy.distributed_sampler_kwargs  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        kwargs = None
    if isinstance(kwargs, Mapping) and "rank" in kwargs and "num_replicas" in kwargs:
        return int(kwargs["rank"]), int(kwargs["num_replicas"])
    return trainer.global_rank, trainer.world_size


def mesh_layout(trainer: pl.Trainer) -> dict[str, int] | None:
    """``{"data_parallel": 2, "tensor_parallel": 1}``: the strategy's device mesh, or ``None`` without one."""
    try:
        mesh = trainer.strategy.device_mesh  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return None
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return {str(name): int(size) for name, size in zip(names, mesh.mesh.shape)}


def describe_mesh(layout: Mapping[str, int]) -> str:
    """``"data_parallel=2 x tensor_parallel=1 (2 processes)"``."""
    processes = 1
    for size in layout.values():
        processes *= int(size)
    dims = " x ".join(f"{name}={size}" for name, size in layout.items())
    return f"{dims} ({processes} process{'es' if processes != 1 else ''})"


def check_mesh_layout(saved: Any, current: Mapping[str, int] | None, strict: bool) -> None:
    """Refuse (``strict``) or warn when the checkpoint's device mesh is not this run's, naming both.

    Raises:
        ShardingLayoutMismatchError: under ``strict``, the meshes differ.
    """
    if not saved or current is None or dict(saved) == dict(current):
        return
    message = (
        f"DeterminismCallback: the checkpoint was written on the device mesh {describe_mesh(saved)}, this run has"
        f" {describe_mesh(current)}. The data shards, the per-rank RNG streams and the gradient reduce-scatter are"
        " functions of the mesh, so the resumed run would not continue the same run. HINT: resume with"
        f" ModelParallelStrategy({', '.join(f'{k}_size={v}' for k, v in saved.items())}) on as many processes."
    )
    if strict:
        raise ShardingLayoutMismatchError(message)
    rank_zero_warn(message)


def gather_per_rank(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (collective: every rank calls it); ``[value]`` in one process."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [value]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def own_rank_value(per_rank: Any, rank: int, world_size: int) -> Any:
    """This rank's entry of a :func:`gather_per_rank` list, or ``None`` when it was written by another world size."""
    if isinstance(per_rank, list) and len(per_rank) == world_size and 0 <= rank < world_size:
        return per_rank[rank]
    return None
