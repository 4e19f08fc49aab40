"""DeepEP's own compiled ops, in the ``deepep::`` namespace of the plugin's extension build.

Each op has a typed Python wrapper (argument checks, the fake kernel for tracing) and a pure-PyTorch
reference, the fallback without a compiler and the tests' oracle. The C++/CUDA sources are in
``extensions/csrc/deepep``; the plugin's loader (:func:`deepep_lightning.ops.extension_available`)
builds them with its own kernels in one library. ``cartpole_rollout``'s Python side is the agent's
(:mod:`deepep_lightning.deepep.agent.fused_rollout`). Importing this package adds the value head's rows to
the audit's L1 catalogue (:mod:`deepep_lightning.deepep.kernels.audit_entries`).
"""

from deepep_lightning.audit.catalogue import register
from deepep_lightning.deepep.kernels.all_action_q import all_action_q
from deepep_lightning.deepep.kernels.audit_entries import ALL_ACTION_Q_ENTRIES
from deepep_lightning.deepep.kernels.gru_backward import (
    check_gru_cell_backward_inputs,
    gru_cell_backward,
    gru_cell_backward_reference,
    gru_cell_backward_unchecked,
)
from deepep_lightning.deepep.kernels.lambda_returns import (
    check_lambda_returns_inputs,
    lambda_returns,
    lambda_returns_reference,
)
from deepep_lightning.deepep.kernels.reference import all_action_q_reference

register(*ALL_ACTION_Q_ENTRIES)

__all__ = [
    "all_action_q",
    "all_action_q_reference",
    "check_gru_cell_backward_inputs",
    "check_lambda_returns_inputs",
    "gru_cell_backward",
    "gru_cell_backward_reference",
    "gru_cell_backward_unchecked",
    "lambda_returns",
    "lambda_returns_reference",
]
