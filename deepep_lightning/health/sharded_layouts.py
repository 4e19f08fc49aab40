"""Which sharded layouts NaNRollbackCallback's snapshots serve, checked when the fit starts.

A snapshot of a sharded module (FSDP2's ``fully_shard``, tensor parallel: ``DTensor`` parameters) holds
each rank's local shards and restores them in place into the live ``DTensor``\\s
(:mod:`~deepep_lightning.health.state_copies`). That is exact for optimizer state laid out like the
parameters (one entry per element, plus scalars): the optimizers in :data:`SHARDABLE_OPTIMIZERS`.
Two layouts are refused before the first step, naming what and why, rather than half-working:

* an optimizer outside that set: its state may hold factored or global tensors (``Adafactor``'s row
  and column statistics, ``LBFGS``'s history) whose local pieces cannot be restored into a shard;
* parameters offloaded to host memory (FSDP2's ``CPUOffloadPolicy``): the health checks and snapshots
  are not verified with shards living away from the device they compute on.
"""

from __future__ import annotations

from collections.abc import Iterable

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.distributed.tensor import DTensor

__all__ = ["SHARDABLE_OPTIMIZERS", "check_sharded_layout"]

#: Optimizers whose state is elementwise in the parameter's layout (or scalar): shard snapshots restore them exactly.
SHARDABLE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Rprop,
)


def check_sharded_layout(pl_module: pl.LightningModule, optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Refuse a sharded module whose optimizer or offloading the snapshots cannot serve; nothing for a plain one.

    Raises:
        MisconfigurationException: an optimizer outside :data:`SHARDABLE_OPTIMIZERS`, or a parameter
            whose shard lives on another device type than its device mesh (CPU offload).
    """
    sharded = {name: p for name, p in pl_module.named_parameters() if isinstance(p, DTensor)}
    if not sharded:
        return
    for name, param in sharded.items():
        shard_device, mesh_device = param.to_local().device.type, param.device_mesh.device_type
        if shard_device != mesh_device:
            raise MisconfigurationException(
                f"NaNRollbackCallback cannot serve parameters offloaded away from their mesh: {name!r} is sharded"
                f" on a {mesh_device!r} mesh and its shard lives on {shard_device!r} (FSDP2"
                " `fully_shard(offload_policy=CPUOffloadPolicy())`). Its snapshots and health checks are not"
                " verified with offloaded shards. HINT: shard without CPU offload, or train without"
                " NaNRollbackCallback."
            )
    for optimizer in optimizers:
        inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the torch one
        if not isinstance(inner, SHARDABLE_OPTIMIZERS):
            allowed = ", ".join(cls.__name__ for cls in SHARDABLE_OPTIMIZERS)
            raise MisconfigurationException(
                f"NaNRollbackCallback cannot snapshot the state of optimizer={type(inner).__name__!r} for sharded"
                f" (DTensor) parameters such as {next(iter(sharded))!r}: its state is not known to be laid out like"
                " the parameters, so this rank's pieces of it could not be restored into its shards exactly."
                f" HINT: use one of {allowed}."
            )
