"""DeterminismCallback's ``configure`` at ``setup``: applied once, in time for CUDA, not undone since.

The callback calls :func:`~deepep_lightning.determinism.configuration.configure` with its own
settings unless the last ``configure`` call already had them (then it only reseeds the global RNGs,
as ``configure`` does, so the stream at fit start is a function of the seed and not of what the
process drew before). A ``configure`` that comes after CUDA started may miss settings read when
CUDA and cuBLAS start; ``strict`` refuses it, naming what to move. A deterministic-algorithms flag
changed since (``Trainer(deterministic=...)``, built after its callbacks, or user code) is said and
set back to the configured value.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from deepep_lightning.determinism.configuration import ConfigureRecord, configure, last_configure_record
from deepep_lightning.determinism.rng import seed_everything_from
from deepep_lightning.determinism.trainer_flag import warn_if_trainer_deterministic_conflicts

__all__ = ["configure_at_setup", "deterministic_flags"]


def deterministic_flags() -> tuple[bool, bool]:
    """(deterministic algorithms on, warn_only) as torch has them now."""
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _record_matches(record: ConfigureRecord | None, seed: int, configure_kwargs: dict[str, Any]) -> bool:
    if record is None or record.seed != seed:
        return False
    return (
        record.deterministic_algorithms == configure_kwargs["deterministic_algorithms"]
        and record.warn_only == configure_kwargs["warn_only"]
        and record.fill_uninitialized_memory == configure_kwargs["fill_uninitialized_memory"]
    )


def configure_at_setup(
    seed: int, configure_kwargs: dict[str, Any], *, strict: bool, flags_at_init: tuple[bool, bool]
) -> ConfigureRecord:
    """Make the process configured as ``configure(seed, **configure_kwargs)`` says; returns the record.

    ``flags_at_init`` are the :func:`deterministic_flags` read when the callback was built: a
    change since then is checked against ``configure_kwargs``.

    Raises:
        MisconfigurationException: under ``strict``, CUDA was in use before ``configure`` ran.
    """
    flags = deterministic_flags()
    if flags != flags_at_init:  # set by Trainer(deterministic=...) or code since __init__
        warn_if_trainer_deterministic_conflicts(
            "warn" if flags == (True, True) else flags[0],
            configure_kwargs["deterministic_algorithms"],
            configure_kwargs["warn_only"],
        )
    record = last_configure_record()
    if record is None or not _record_matches(record, seed, configure_kwargs):
        record = configure(seed, **configure_kwargs)
    else:  # what configure() seeds: the stream at fit start is a function of the seed, not of the process
        seed_everything_from(seed, "global")
    if record.too_late:
        message = (
            f"DeterminismCallback: CUDA was in use (device memory allocated, so cuBLAS may have started)"
            f" before configure() set {', '.join(record.too_late)}: settings read when CUDA/cuBLAS start"
            " may not take effect. HINT: call"
            " `deepep_lightning.configure(seed)` before anything touches CUDA: before `model.cuda()`,"
            " `torch.randn(..., device='cuda')`, `torch.cuda.*` queries and `trainer.fit(...)` (the"
            " Trainer starts CUDA before this callback's `setup`); or export CUBLAS_WORKSPACE_CONFIG"
            " in the shell."
        )
        if strict:
            raise MisconfigurationException(message)
        rank_zero_warn(message)
    if torch.are_deterministic_algorithms_enabled() != record.deterministic_algorithms:
        rank_zero_warn("DeterminismCallback: deterministic-algorithms flag changed after configure(); re-applied")
        torch.use_deterministic_algorithms(record.deterministic_algorithms, warn_only=record.warn_only)
    return record
