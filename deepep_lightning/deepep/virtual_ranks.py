"""DeepEP's virtual ranks: the rollouts of ``K`` ranks on any number of processes dividing ``K``.

With ``DeterministicDDPStrategy(virtual_world_size=K)`` a process of ``W`` owns the virtual ranks
``rank * K/W ... (rank + 1) * K/W - 1``, each with its own environments, recurrent state and
generator (seeded from ``derive_seed(seed, "env_init", v)`` and ``derive_seed(seed, "rollout", v,
step)``). Training step ``s`` of the module is one micro-batch per virtual rank, in virtual-rank
order (``accumulate_grad_batches = K / W``); the strategy adds their gradients in virtual-rank order
(:mod:`~deepep_lightning.strategies.micro_batch_gradients`, or the ordered hook when ``W = K``).
At a window's last micro-batch the per-virtual-rank scalars and finished episodes of every process
are gathered rank-major, so every process logs the mean of the ``K`` virtual ranks summed in order
and feeds the rolling return the ``K`` rollouts in order: the same bits whatever ``W``.

Cost: ``K / W`` sets of environments and recurrent states per process (memory), ``K / W`` rollouts
per optimizer step (time: the global batch is ``K`` rollouts whatever ``W``), and one small gather
of the scalars and episode returns per optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.deepep.envs import BatchedEnv
from deepep_lightning.strategies.ordered_reduction import ordered_sum

__all__ = ["VirtualRollout", "check_virtual_support", "gather_rows", "ordered_mean", "virtual_layout"]


@dataclass
class VirtualRollout:
    """What one virtual rank carries from step to step."""

    rank: int
    env: BatchedEnv
    hidden: torch.Tensor
    generator: torch.Generator


def virtual_layout(strategy: Any) -> tuple[int, int] | None:
    """``(first virtual rank of this process, virtual ranks per process)``, or None without ``virtual_world_size``."""
    if getattr(strategy, "virtual_world_size", None) is None:
        return None
    return int(strategy.virtual_rank(0)), int(strategy.micro_batches_per_step)


def check_virtual_support(hparams: Any) -> None:
    """Refuse the options whose per-process state would follow the process count.

    Raises:
        MisconfigurationException: ``cuda_graph``, ``compile_step`` or ``target_entropy`` is set.
    """
    for name, value, why in (
        ("cuda_graph", hparams.cuda_graph, "the graph holds one rollout per step; virtual ranks accumulate several"),
        ("compile_step", hparams.compile_step, "the compiled timestep is bound to one set of environments"),
        (
            "target_entropy",
            hparams.target_entropy,
            "the adaptive coefficient would move once per virtual rank of a process",
        ),
    ):
        if value not in (None, False):
            raise MisconfigurationException(
                f"`DeepEPModule({name}={value!r})` is not supported with"
                f" `DeterministicDDPStrategy(virtual_world_size=...)`: {why}. HINT: leave {name} at its default"
            )


def gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every process's ``rows`` stacked rank-major (row ``v`` is virtual rank ``v``); ``rows`` itself on one process."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return rows
    flat = rows.contiguous().reshape(-1)
    gathered = flat.new_empty(dist.get_world_size() * flat.numel())
    dist.all_gather_into_tensor(gathered, flat)
    return gathered.view(-1, *rows.shape[1:])


def ordered_mean(rows: torch.Tensor) -> torch.Tensor:
    """``(((rows[0] + rows[1]) + rows[2]) + ...) / len(rows)``: the same bits for the same rows, whatever ``W``."""
    return ordered_sum(rows).div_(rows.shape[0])
