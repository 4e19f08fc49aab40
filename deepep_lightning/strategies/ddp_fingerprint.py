"""The fingerprint of DeterministicDDPStrategy: every communication and data setting that changes bits.

Two runs are bitwise equal only with the same backend, world size, node layout, gradient reduction,
DDP bucket settings, NCCL profile, seeds and world-size-invariant partition; the fingerprint records
each as a string, so a checkpoint carries it and a resume can say which one differs. The strategy
logs it at train start on rank 0, as one line and as a TensorBoard table (:func:`log_fingerprint`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from deepep_lightning import _lightning_compat

if TYPE_CHECKING:
    from deepep_lightning.strategies.deterministic_ddp import DeterministicDDPStrategy

__all__ = ["ddp_fingerprint", "log_fingerprint"]


def ddp_fingerprint(strategy: DeterministicDDPStrategy) -> dict[str, str]:
    """Everything about ``strategy``'s communication and data layout that changes bits, as strings."""
    kwargs = _lightning_compat.ddp_kwargs(strategy)
    comm_hook = _lightning_compat.ddp_comm_hook(strategy)
    record = {
        "ddp.strategy": type(strategy).__name__,
        "ddp.backend": str(_lightning_compat.process_group_backend(strategy) or "<not started>"),
        "ddp.world_size": str(strategy.world_size),
        "ddp.num_nodes": str(strategy.num_nodes),
        "ddp.node_layout": strategy.node_layout,
        "ddp.cluster_environment": type(strategy.cluster_environment).__name__,
        "ddp.gradient_reduction": strategy.resolved_gradient_reduction,
        "ddp.bucket_cap_mb": str(kwargs.get("bucket_cap_mb")),
        "ddp.gradient_as_bucket_view": str(kwargs.get("gradient_as_bucket_view")),
        "ddp.static_graph": str(kwargs.get("static_graph")),
        "ddp.find_unused_parameters": str(kwargs.get("find_unused_parameters")),
        "ddp.broadcast_buffers": str(kwargs.get("broadcast_buffers", True)),
        "ddp.comm_hook": getattr(comm_hook, "__qualname__", str(comm_hook)),
        "ddp.nccl_algorithm": strategy.nccl_algorithm,
        "ddp.nccl_protocol": strategy.nccl_protocol,
        "ddp.seed": str(strategy.seed),
        "ddp.sampler_seed": str(strategy.sampler_seed),
        "ddp.rank_seeds": json.dumps(strategy.rank_seeds),
        "ddp.reseed_every_step": str(strategy.reseed_every_step),
        "ddp.virtual_world_size": str(strategy.virtual_world_size),
        "torch": str.__str__(str(torch.__version__)),
    }
    for name, value in strategy.nccl_env.items():
        record[f"env.{name}"] = value
    return record


def log_fingerprint(trainer: pl.Trainer, record: dict[str, str]) -> None:
    """Say ``record`` in one line and add it to TensorBoard's text tab as a table, fields sorted."""
    rank_zero_info("DeterministicDDPStrategy: " + ", ".join(f"{k}={v}" for k, v in record.items()))
    text = "\n".join(["| field | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in sorted(record.items()))])
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text("ddp/fingerprint", text, global_step=trainer.global_step)
