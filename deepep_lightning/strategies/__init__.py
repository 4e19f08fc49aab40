"""deepep_lightning.strategies: ``DeterministicDDPStrategy``, registered as ``"ddp_deterministic"``.

Importing this package registers the name in Lightning's ``StrategyRegistry`` (idempotent: a second
registration replaces the entry by the same class). ``deepep_lightning/__init__.py`` imports it, so
``import deepep_lightning`` is what makes ``Trainer(strategy="ddp_deterministic")`` work.
"""

from lightning.pytorch.strategies import StrategyRegistry

from deepep_lightning.determinism.nccl_profile import apply_nccl_profile, nccl_profile
from deepep_lightning.strategies.deterministic_ddp import DeterministicDDPStrategy
from deepep_lightning.strategies.rank_state import CHECKPOINT_KEY, WorldSizeMismatchError

__all__ = ["CHECKPOINT_KEY", "DeterministicDDPStrategy", "WorldSizeMismatchError", "apply_nccl_profile", "nccl_profile"]

DeterministicDDPStrategy.register_strategies(StrategyRegistry)
