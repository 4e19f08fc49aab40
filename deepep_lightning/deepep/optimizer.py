"""DeepEP's optimizer: one param group per learning rate (critic, policy, recurrent cell) and the LR stairs."""

from __future__ import annotations

from typing import Any

import torch

from deepep_lightning.deepep.agent import DeepEPAgent
from deepep_lightning.deepep.config import OptimConfig
from deepep_lightning.deepep.lr_decay import lr_stairs

__all__ = ["deepep_optimizer"]


def deepep_optimizer(agent: DeepEPAgent, optim: OptimConfig, capturable: bool) -> Any:
    """Adam (or SGD) over ``agent``'s trainable parameters, the critic's, the policy's and the recurrent cell's rates
    as param groups: what ``DeepEPModule.configure_optimizers`` returns.

    Args:
        agent: the networks; the policy network is group 1, the recurrent cell group 2 when it has its own rate
            (``recurrent_learning_rate``), every other trainable parameter group 0.
        optim: the rates, the optimizer and the decay.
        capturable: ``Adam(capturable=True)``, which a CUDA graph needs.

    Returns:
        The optimizer; with ``lr_decay_steps``, a dict with it and its stairs
        (:func:`~deepep_lightning.deepep.lr_decay.lr_stairs`, stepped after every optimizer step).
    """
    policy_params = list(agent.policy_net.parameters())
    # the recurrent cell is a group of its own (the third) only with its own rate, so the default groups stay
    recurrent_params = list(agent.rnn_cell.parameters()) if optim.recurrent_learning_rate is not None else []
    own_ids = {id(p) for p in policy_params + recurrent_params}
    other_params = [p for p in agent.parameters() if id(p) not in own_ids and p.requires_grad]
    groups: list[dict[str, Any]] = [
        {"params": other_params, "lr": optim.learning_rate},
        {"params": policy_params, "lr": optim.policy_learning_rate or optim.learning_rate},
    ]
    if recurrent_params:
        groups.append({"params": recurrent_params, "lr": optim.recurrent_learning_rate})
    if optim.policy_adam_eps is not None:
        groups[1]["eps"] = optim.policy_adam_eps
    if optim.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(groups, lr=optim.learning_rate)
    else:
        optimizer = torch.optim.Adam(groups, lr=optim.learning_rate, capturable=capturable)
    if optim.lr_decay_steps is None:
        return optimizer
    scheduler = lr_stairs(optimizer, optim.lr_decay_steps, optim.lr_decay_stages)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
