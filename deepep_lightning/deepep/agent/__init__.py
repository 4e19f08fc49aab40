"""The DeepEP agent: network, rollout loop and expected-policy-gradient loss."""

from deepep_lightning.deepep.agent.loss import LossTerms, deepep_loss, lambda_returns
from deepep_lightning.deepep.agent.network import AgentStep, DeepEPAgent, sample_categorical
from deepep_lightning.deepep.agent.rollout import Rollout, collect_rollout
from deepep_lightning.deepep.agent.value_head import AllActionValueHead

__all__ = [
    "AgentStep",
    "AllActionValueHead",
    "DeepEPAgent",
    "LossTerms",
    "Rollout",
    "collect_rollout",
    "deepep_loss",
    "lambda_returns",
    "sample_categorical",
]
