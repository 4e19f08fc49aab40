"""deepep_lightning.strategies: ``DeterministicDDPStrategy``, registered as ``"ddp_deterministic"``.

Importing this package is cheap (no Lightning import): the strategy class loads on first use and
the registration runs as soon as ``lightning.pytorch`` is imported (see ``_registration.py``).
"""

from __future__ import annotations

import importlib
from typing import Any

from deepep_lightning.strategies._registration import register_when_lightning_loads

_EXPORTS = {
    "CHECKPOINT_KEY": "deepep_lightning.strategies.rank_state",
    "DeterministicDDPStrategy": "deepep_lightning.strategies.deterministic_ddp",
    "WorldSizeMismatchError": "deepep_lightning.strategies.rank_state",
    "apply_nccl_profile": "deepep_lightning.strategies.nccl_profile",
    "nccl_profile": "deepep_lightning.strategies.nccl_profile",
}

__all__ = list(_EXPORTS)

register_when_lightning_loads()


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'deepep_lightning.strategies' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
