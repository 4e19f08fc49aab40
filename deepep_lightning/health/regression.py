"""RegressionTrigger: when a monitored metric collapses from its best, for the rollback to restore the best snapshot.

A NaN is not the only way to lose a run: a policy that earned 498 and then earns 11 for good is
finite everywhere. This trigger follows a logged metric at the health checks (where the host
reads anyway: no per-step synchronisation) and fires when the metric has been worse than its best
by more than a threshold for ``patience`` checks in a row. :class:`~deepep_lightning.NaNRollbackCallback`
then restores the snapshot with the best value and applies its policy.

Compared with Lightning's ``SpikeDetection`` (which raises on a loss spike and can only be told
to skip those batches on the next run): this trigger watches any logged metric, in either
direction, with a relative or absolute threshold and a patience; it acts inside the run (restore,
then ``lower_lr``, ``skip`` or ``stop``, with the rollback's retry cap); its decisions are the same
on every rank (the value is averaged over ranks); and its state is in the checkpoint and resumes.
``SpikeDetection.load_state_dict`` reads ``self.running``, an attribute the class never sets, so
its state cannot be restored.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any, Literal, get_args

from deepep_lightning import _checks

__all__ = ["RegressionTrigger", "RegressionVerdict"]

#: Whether larger (``"max"``, a return) or smaller (``"min"``, a loss) values of the metric are better.
Mode = Literal["max", "min"]
#: Whether ``threshold`` is a fraction of ``|best|`` (``"rel"``) or in the metric's units (``"abs"``).
ThresholdMode = Literal["rel", "abs"]
_MODES: tuple[str, ...] = get_args(Mode)
_THRESHOLD_MODES: tuple[str, ...] = get_args(ThresholdMode)


class RegressionVerdict(Enum):
    """What one check means to the rollback."""

    NONE = "none"  # nothing to do
    COLLAPSED = "collapsed"  # past the threshold for ``patience`` checks: roll back now
    RECOVERED = "recovered"  # a rollback has held for ``patience`` checks: the collapse is over


class RegressionTrigger:
    r"""Fires when ``monitor`` falls from its best by more than ``threshold`` for ``patience`` checks.

    Pass it to :class:`~deepep_lightning.NaNRollbackCallback` (``regression=``); the rollback reads
    the metric from ``trainer.callback_metrics`` at each healthy check, averaged over ranks.

    Args:
        monitor: a metric the module logs (``self.log("train/return", ...)``).
        mode: ``"max"`` (larger is better) or ``"min"``.
        threshold: how far from the best counts as a collapse; with ``threshold_mode="rel"`` a
            fraction of ``|best|`` (0.5: half of the best is lost), with ``"abs"`` in the metric's units.
        threshold_mode: ``"rel"`` or ``"abs"``.
        patience: checks in a row past the threshold before firing (a single bad batch is noise).
        warmup_checks: checks before the best is taken seriously (an untrained model's first
            values are not a level to hold).

    Raises:
        MisconfigurationException: an invalid argument.

    Example::

        NaNRollbackCallback(policy="lower_lr", regression=RegressionTrigger("train/return", mode="max",
                                                                           threshold=0.5, patience=3))
    """

    def __init__(
        self,
        monitor: str,
        mode: Mode = "max",
        threshold: float = 0.5,
        threshold_mode: ThresholdMode = "rel",
        patience: int = 3,
        warmup_checks: int = 0,
    ) -> None:
        owner = "RegressionTrigger"
        self.monitor: str = _checks.non_empty_str(owner, "monitor", monitor)
        self.mode: Mode = _checks.choice(owner, "mode", mode, _MODES)
        self.threshold_mode: ThresholdMode = _checks.choice(owner, "threshold_mode", threshold_mode, _THRESHOLD_MODES)
        self.threshold = float(
            _checks.number(owner, "threshold", threshold, minimum=0, exclusive_minimum=True, finite=True)
        )
        self.patience: int = _checks.int_at_least(owner, "patience", patience, 1)
        self.warmup_checks: int = _checks.int_at_least(owner, "warmup_checks", warmup_checks, 0)
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad_checks = 0  # checks in a row past the threshold
        self.held_checks = 0  # checks in a row within the threshold since the last rollback
        self.checks = 0
        self.attempts = 0  # rollbacks of the current collapse (0 once the metric has held or improved)

    def _better(self, value: float, than: float) -> bool:
        return value > than if self.mode == "max" else value < than

    def collapsed(self, value: float) -> bool:
        """Whether ``value`` is further than the threshold from the best (NaN always is)."""
        if self.best is None:
            return False
        if not math.isfinite(value):
            return True
        margin = self.threshold * abs(self.best) if self.threshold_mode == "rel" else self.threshold
        return value < self.best - margin if self.mode == "max" else value > self.best + margin

    def update(self, value: float, step: int) -> RegressionVerdict:
        """Take the value of one check at ``step``: whether the rollback must act now, or a rollback has held.

        After a rollback the collapse counts as recovered once the metric sets a new best or stays
        within the threshold for ``patience`` checks in a row; a later collapse is a new one, with
        ``max_retries`` rollbacks of its own. A metric at its ceiling (a return of 500 out of 500)
        cannot improve, so holding is the only way such a run recovers.
        """
        self.checks += 1
        if self.checks <= self.warmup_checks:
            return RegressionVerdict.NONE
        if math.isfinite(value) and (self.best is None or self._better(value, self.best)):
            self.best, self.best_step, self.bad_checks = float(value), int(step), 0
            return self._held(self.patience)
        if not self.collapsed(value):
            self.bad_checks = 0
            return self._held(self.held_checks + 1)
        self.held_checks = 0
        self.bad_checks += 1
        return RegressionVerdict.COLLAPSED if self.bad_checks >= self.patience else RegressionVerdict.NONE

    def _held(self, checks: int) -> RegressionVerdict:
        """Count a healthy check after a rollback; RECOVERED when that makes ``patience`` of them."""
        if self.attempts == 0:
            return RegressionVerdict.NONE
        self.held_checks = checks
        if self.held_checks < self.patience:
            return RegressionVerdict.NONE
        self.attempts, self.held_checks = 0, 0
        return RegressionVerdict.RECOVERED

    def rolled_back(self) -> None:
        """A rollback of the current collapse: one more attempt, and the counts start again from the snapshot."""
        self.attempts += 1
        self.bad_checks = self.held_checks = 0

    def rank(self, values: dict[int, float]) -> list[int]:
        """Steps of ``values`` (snapshot step -> metric value there) from the best value to the worst."""
        finite = [step for step, value in values.items() if math.isfinite(value)]
        return sorted(finite, key=lambda step: (-values[step] if self.mode == "max" else values[step], -step))

    def describe(self, value: float) -> str:
        return (
            f"{self.monitor}={value:.6g} is worse than its best {self.best:.6g} (step {self.best_step}) by more "
            f"than threshold={self.threshold!r} ({self.threshold_mode}) for {self.patience} check(s)"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_step": self.best_step,
            "bad_checks": self.bad_checks,
            "held_checks": self.held_checks,
            "checks": self.checks,
            "attempts": self.attempts,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")
        self.best_step = state_dict.get("best_step")
        self.bad_checks = int(state_dict.get("bad_checks", 0))
        self.held_checks = int(state_dict.get("held_checks", 0))
        self.checks = int(state_dict.get("checks", 0))
        self.attempts = int(state_dict.get("attempts", 0))
