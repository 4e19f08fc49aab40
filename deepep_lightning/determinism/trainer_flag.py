"""``Trainer(deterministic=...)`` next to ``DeterminismCallback``: which one's settings hold, said out loud.

Lightning applies ``Trainer(deterministic=...)`` when the Trainer is built
(``torch.use_deterministic_algorithms(True)``, ``warn_only=True`` for ``"warn"``, off for False);
``DeterminismCallback`` applies its own settings again at ``setup``, after that. So when both are
given and disagree, the callback's settings win, and :func:`warn_if_trainer_deterministic_conflicts`
says so (a warning, not a refusal: the callback's settings are the stricter, documented ones, and a
config that also sets the Trainer flag should still run). ``Trainer(deterministic=None)`` (the
default) or a value that agrees with the callback is silent.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["trainer_deterministic_conflict", "warn_if_trainer_deterministic_conflicts"]


def _trainer_settings(trainer_deterministic: Any) -> tuple[bool, bool] | None:
    """(deterministic algorithms on, warn_only) that ``Trainer(deterministic=value)`` applies; None: untouched."""
    if trainer_deterministic is None:
        return None
    if trainer_deterministic == "warn":
        return True, True
    if isinstance(trainer_deterministic, bool):
        return trainer_deterministic, False
    raise ValueError(f"`Trainer(deterministic=...)` must be None, a bool or 'warn', got {trainer_deterministic!r}")


def trainer_deterministic_conflict(
    trainer_deterministic: bool | str | None, deterministic_algorithms: bool, warn_only: bool
) -> str | None:
    """The warning for a ``Trainer(deterministic=...)`` that disagrees with ``DeterminismCallback``'s settings.

    Args:
        trainer_deterministic: what the user passed to ``Trainer(deterministic=...)``.
        deterministic_algorithms / warn_only: ``DeterminismCallback``'s arguments of those names.

    Returns:
        The message (the callback's settings win), or None when they agree or the Trainer left it at None.

    Raises:
        ValueError: ``trainer_deterministic`` is not None, a bool or ``"warn"``.

    Example::

        message = trainer_deterministic_conflict("warn", deterministic_algorithms=True, warn_only=False)
    """
    trainer = _trainer_settings(trainer_deterministic)
    callback = (bool(deterministic_algorithms), bool(warn_only) and bool(deterministic_algorithms))
    if trainer is None or (trainer[0] == callback[0] and (not trainer[0] or trainer[1] == callback[1])):
        return None
    wins = f"deterministic algorithms {'on' if callback[0] else 'off'}" + (
        f" (warn_only={callback[1]})" if callback[0] else ""
    )
    return (
        f"Trainer(deterministic={trainer_deterministic!r}) disagrees with DeterminismCallback("
        f"deterministic_algorithms={deterministic_algorithms!r}, warn_only={warn_only!r}): the callback applies "
        f"its settings at setup, after the Trainer, so they win: {wins}. HINT: leave `Trainer(deterministic=...)` "
        "unset with DeterminismCallback, and set `DeterminismCallback(warn_only=True)` to only warn on "
        "nondeterministic ops."
    )


def warn_if_trainer_deterministic_conflicts(
    trainer_deterministic: bool | str | None, deterministic_algorithms: bool, warn_only: bool
) -> bool:
    """``rank_zero_warn`` :func:`trainer_deterministic_conflict`'s message when there is one; returns whether."""
    message = trainer_deterministic_conflict(trainer_deterministic, deterministic_algorithms, warn_only)
    if message is not None:
        rank_zero_warn(message)
    return message is not None
