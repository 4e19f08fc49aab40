"""Checkpoints that survive: atomic writes, a full disk named clearly, preemption signals turned into a checkpoint."""

from deepep_lightning.checkpointing.checkpoint_io import AtomicCheckpointIO, CheckpointWriteError
from deepep_lightning.checkpointing.preemption import PreemptionCallback, exit_code_for

__all__ = ["AtomicCheckpointIO", "CheckpointWriteError", "PreemptionCallback", "exit_code_for"]
