"""The DeepEP agent: network, rollout loop and expected-policy-gradient loss."""

from deepep_lightning.deepep.agent.compiled_step import CompiledTimestep, compile_unavailable_reason
from deepep_lightning.deepep.agent.fused_bptt import collect_rollout_fused, fused_bptt_unsupported_reason, gru_sequence
from deepep_lightning.deepep.agent.loss import LossTerms, deepep_loss, lambda_returns
from deepep_lightning.deepep.agent.network import AgentStep, DeepEPAgent, sample_categorical
from deepep_lightning.deepep.agent.rollout import Rollout, Timestep, collect_rollout, eager_timestep
from deepep_lightning.deepep.agent.value_head import AllActionValueHead

__all__ = [
    "AgentStep",
    "AllActionValueHead",
    "CompiledTimestep",
    "DeepEPAgent",
    "LossTerms",
    "Rollout",
    "Timestep",
    "collect_rollout",
    "collect_rollout_fused",
    "compile_unavailable_reason",
    "deepep_loss",
    "eager_timestep",
    "fused_bptt_unsupported_reason",
    "gru_sequence",
    "lambda_returns",
    "sample_categorical",
]
