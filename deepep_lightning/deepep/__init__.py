"""DeepEP, the reference workload: a recurrent all-action expected-policy-gradient agent.

A *user* of the plugin: it imports ``deepep_lightning``'s layers and implements the workload protocol
(:mod:`deepep_lightning.protocols`); nothing in the plugin imports it.
"""

from deepep_lightning.deepep.config import (
    DeepEPConfig,
    EnvConfig,
    ExecutionConfig,
    LossConfig,
    NetworkConfig,
    OptimConfig,
    grouped,
)
from deepep_lightning.deepep.episode_return import EpisodeReturnMean
from deepep_lightning.deepep.module import DeepEPModule

__all__ = [
    "DeepEPConfig",
    "DeepEPModule",
    "EnvConfig",
    "EpisodeReturnMean",
    "ExecutionConfig",
    "LossConfig",
    "NetworkConfig",
    "OptimConfig",
    "grouped",
]
