"""Batched, seeded PyTorch environments (no Python loop over environments)."""

from deepep_lightning.deepep.envs.base import BatchedEnv, StepResult
from deepep_lightning.deepep.envs.cartpole import BatchedCartPole
from deepep_lightning.deepep.envs.memory import CueRecall
from deepep_lightning.deepep.envs.registry import ENVIRONMENTS, make_env

__all__ = ["ENVIRONMENTS", "BatchedCartPole", "BatchedEnv", "CueRecall", "StepResult", "make_env"]
