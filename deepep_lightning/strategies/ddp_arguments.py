"""The constructor arguments of DeterministicDDPStrategy that it checks before DDP sees them.

Every argument is checked up front, so a wrong type or value fails at construction with a message
naming the argument and the value instead of deep inside ``init_process_group`` or DDP. The NCCL
algorithm is limited to those that reduce in a fixed order (:mod:`~deepep_lightning.determinism.nccl_profile`),
and ``gradient_reduction="ordered"`` refuses a ``ddp_comm_hook`` of its own (it registers one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning import _checks
from deepep_lightning.determinism.nccl_profile import ALLOWED_ALGORITHMS, ALLOWED_PROTOCOLS
from deepep_lightning.strategies.gradient_reduction import GRADIENT_REDUCTIONS

__all__ = ["validate_arguments"]


def validate_arguments(
    seed: Any,
    bucket_cap_mb: Any,
    nccl_algorithm: Any,
    nccl_protocol: Any,
    gradient_reduction: Any,
    ddp_comm_hook: Any,
    per_rank_checkpoint_keys: Sequence[str],
    virtual_world_size: Any,
    *,
    flags: dict[str, Any],
) -> tuple[str, ...]:
    """Check the arguments of ``DeterministicDDPStrategy``; returns ``per_rank_checkpoint_keys`` as a tuple.

    ``flags`` maps the name of each boolean argument to its value.

    Raises:
        MisconfigurationException: an argument has a wrong type or value.
    """
    owner = "DeterministicDDPStrategy"
    _checks.non_negative_int(owner, "seed", seed, allow_none=True)
    _checks.number(owner, "bucket_cap_mb", bucket_cap_mb, minimum=0, exclusive_minimum=True, finite=True)
    _checks.choice(
        owner,
        "nccl_algorithm",
        nccl_algorithm,
        ALLOWED_ALGORITHMS,
        hint="NVLS and CollNet reduce inside the switch in an unspecified order",
    )
    _checks.choice(owner, "nccl_protocol", nccl_protocol, ALLOWED_PROTOCOLS)
    _checks.choice(owner, "gradient_reduction", gradient_reduction, GRADIENT_REDUCTIONS)
    if gradient_reduction == "ordered" and ddp_comm_hook is not None:
        raise MisconfigurationException(
            f"`DeterministicDDPStrategy(gradient_reduction='ordered')` registers its own DDP communication hook,"
            f" so it cannot take `ddp_comm_hook={ddp_comm_hook!r}` too. HINT: pass"
            " gradient_reduction='auto' to use your hook."
        )
    keys = _checks.str_sequence(owner, "per_rank_checkpoint_keys", per_rank_checkpoint_keys)
    _checks.positive_int(owner, "virtual_world_size", virtual_world_size, allow_none=True)
    for name, flag in flags.items():
        _checks.strict_bool(owner, name, flag)
    return keys
