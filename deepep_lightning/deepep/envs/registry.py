"""Environment names accepted by ``EnvConfig(name=...)``."""

from __future__ import annotations

from typing import Any

import torch

from deepep_lightning.deepep.envs.base import BatchedEnv
from deepep_lightning.deepep.envs.cartpole import BatchedCartPole
from deepep_lightning.deepep.envs.memory import CueRecall

__all__ = ["ENVIRONMENTS", "make_env"]

ENVIRONMENTS: dict[str, type[BatchedEnv]] = {"cartpole": BatchedCartPole, "memory": CueRecall}


def make_env(name: str, num_envs: int, device: torch.device | str = "cpu", **env_kwargs: Any) -> BatchedEnv:
    """Build the batched environment registered as ``name``.

    Raises:
        ValueError: ``name`` is not registered, or an env argument is invalid.
    """
    if name not in ENVIRONMENTS:
        raise ValueError(f"env must be one of {sorted(ENVIRONMENTS)}, got {name!r}")
    try:
        return ENVIRONMENTS[name](num_envs, device, **env_kwargs)
    except TypeError as error:
        raise ValueError(f"env_kwargs {env_kwargs!r} do not fit env {name!r}: {error}") from error
