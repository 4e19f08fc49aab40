"""What a checkpoint records about the distributed layout: world size, seeds, every rank's own state.

Lightning writes a checkpoint from rank 0 only, so rank-local state (a callback's RNG streams, a
module's rollout state such as DeepEP's environments and recurrent state) of the other ranks is
lost, and on resume every rank loads rank 0's copy. :func:`build_rank_state` gathers each rank's
copy of the rank-local keys into ``checkpoint["deterministic_ddp"]["per_rank"]`` (collective: every
rank calls it), and :func:`apply_rank_state` puts this rank's copy back. The world size is stored next to them:
shards, per-rank seeds, rollout streams and the all-reduce order are all functions of it, so
:func:`check_world_size` refuses a resume with another one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from deepep_lightning.determinism.fingerprint import describe_layout

__all__ = [
    "CHECKPOINT_KEY",
    "WorldSizeMismatchError",
    "apply_rank_state",
    "build_rank_state",
    "check_world_size",
]

#: Where the strategy's state lives in a Lightning checkpoint.
CHECKPOINT_KEY = "deterministic_ddp"
_STATE_VERSION = 1


class WorldSizeMismatchError(MisconfigurationException):
    """A checkpoint written with one world size is resumed with another."""


def _gather(local: Any, world_size: int) -> list[Any]:
    if world_size <= 1 or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return [local]
    gathered: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(gathered, local)
    return gathered


def build_rank_state(
    checkpoint: Mapping[str, Any], per_rank_keys: Iterable[str], world_size: int, **record: Any
) -> dict[str, Any]:
    """The strategy's checkpoint entry: ``record`` (seeds, fingerprint), world size, every rank's keys.

    Collective under DDP: every rank must call it (``Trainer.save_checkpoint`` runs on all ranks).
    """
    local = {key: checkpoint[key] for key in per_rank_keys if key in checkpoint}
    return {"version": _STATE_VERSION, "world_size": int(world_size), **record, "per_rank": _gather(local, world_size)}


def check_world_size(
    state: Mapping[str, Any], world_size: int, allow_change: bool = False, num_nodes: int | None = None
) -> None:
    """Refuse a checkpoint written with another world size (warn instead when ``allow_change``).

    The message names both node layouts when the checkpoint records its own (``num_nodes`` and
    ``processes_per_node``) and ``num_nodes`` (this run's) is given.

    Raises:
        WorldSizeMismatchError: the sizes differ and ``allow_change`` is False.
    """
    saved = int(state.get("world_size", world_size))
    if saved == world_size:
        return
    layouts = []
    if state.get("num_nodes") and state.get("processes_per_node"):
        layouts.append(f"the checkpoint's {describe_layout(int(state['num_nodes']), int(state['processes_per_node']))}")
    if num_nodes:
        layouts.append(f"this run's {describe_layout(num_nodes, world_size // num_nodes)}")
    layout = f" ({' vs '.join(layouts)})" if layouts else ""
    message = (
        f"DeterministicDDPStrategy: the checkpoint was written with world_size={saved}, this run has"
        f" world_size={world_size}{layout}. Data shards, per-rank seeds, rollout streams and the all-reduce"
        " order are functions of the world size, so the resumed run would not continue the same run."
        f" HINT: resume with devices x num_nodes = {saved} (any node layout of that size), or pass"
        " `DeterministicDDPStrategy(allow_world_size_change=True)` to accept a non-reproducible resume."
    )
    if not allow_change:
        raise WorldSizeMismatchError(message)
    rank_zero_warn(message)


def apply_rank_state(checkpoint: dict[str, Any], state: Mapping[str, Any], rank: int, world_size: int) -> bool:
    """Replace the rank-local keys of ``checkpoint`` by this rank's saved copy; ``True`` if done."""
    per_rank = state.get("per_rank") or []
    if len(per_rank) != world_size or not isinstance(per_rank[rank], dict):
        return False
    checkpoint.update(per_rank[rank])
    return True
