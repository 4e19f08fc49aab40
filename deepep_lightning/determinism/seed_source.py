"""Where DeterminismCallback's seed comes from, and whether the model was built after a seed was set.

The seed is the ``seed`` argument, else Lightning's global seed (``PL_GLOBAL_SEED``, set by
``seed_everything`` and LightningCLI's ``seed_everything:``), else the seed of the last
:func:`~deepep_lightning.determinism.configuration.configure` call, else 0. The callback settles it
again at ``setup`` (a ``seed_everything`` call may come after the callback is built) and says which
source it took, so a run's seed is never a silent guess.
"""

from __future__ import annotations

import os

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from deepep_lightning.determinism.configuration import last_configure_record
from deepep_lightning.determinism.rng import unseeded_draws_before_first_seed

__all__ = ["check_seeded_before_model", "lightning_global_seed", "resolve_seed", "warn_if_seed_disagrees"]


def lightning_global_seed() -> int | None:
    """``PL_GLOBAL_SEED`` as an int, or ``None`` when unset or not a non-negative integer."""
    value = os.environ.get("PL_GLOBAL_SEED")
    if value is None:
        return None
    try:
        seed = int(value)
    except ValueError:
        rank_zero_warn(f"DeterminismCallback: ignoring PL_GLOBAL_SEED={value!r}, which is not an integer")
        return None
    return seed if seed >= 0 else None


def resolve_seed(seed_argument: int | None) -> tuple[int, str]:
    """The seed to use and where it comes from (the ``seed`` argument, Lightning, ``configure``, default)."""
    if seed_argument is not None:
        return seed_argument, "the `seed` argument"
    global_seed = lightning_global_seed()
    if global_seed is not None:
        return global_seed, "Lightning's global seed (PL_GLOBAL_SEED, set by `seed_everything`)"
    record = last_configure_record()
    if record is not None:
        return record.seed, "the last `configure(seed)` call"
    return 0, "the default: no `seed` argument, no `seed_everything`, no `configure`"


def warn_if_seed_disagrees(seed_argument: int | None, seed: int) -> None:
    """Warn when an explicit ``seed`` argument differs from ``PL_GLOBAL_SEED`` (the argument wins)."""
    global_seed = lightning_global_seed()
    if seed_argument is not None and global_seed is not None and global_seed != seed:
        rank_zero_warn(
            f"DeterminismCallback: seed={seed!r} disagrees with Lightning's global seed"
            f" PL_GLOBAL_SEED={global_seed!r} (set by `seed_everything` or an earlier `configure`); the"
            f" callback uses seed={seed!r}. HINT: pass the same value to both, or leave `seed` unset"
            " to follow `seed_everything`."
        )


def check_seeded_before_model(strict: bool, drawn_unseeded_in_launcher: bool = False) -> None:
    """Refuse (``strict``) or warn when torch's default generator drew numbers before any seed was set.

    Args:
        strict: raise instead of warning.
        drawn_unseeded_in_launcher: the process that launched this one (``ddp_spawn`` pickles the model
            built there) had drawn from an unseeded generator.

    Raises:
        MisconfigurationException: under ``strict``, the generator drew before any seed, here (also when the
            plugin's own per-rank seeding came after the draws) or in the launching process.
    """
    unseeded = drawn_unseeded_in_launcher or unseeded_draws_before_first_seed()
    if last_configure_record() is not None or not unseeded:
        return
    message = (
        "DeterminismCallback: torch's default generator drew numbers (the model's initial weights,"
        " most likely) before any seed was set, so they differ in every fresh process and two runs"
        " cannot be equal. HINT: call `lightning.pytorch.seed_everything(seed)` or"
        " `deepep_lightning.configure(seed)` before building the model."
    )
    if strict:
        raise MisconfigurationException(message + " (strict=True refuses; strict=False only warns)")
    rank_zero_warn(message)
