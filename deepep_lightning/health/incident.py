"""One incident of :class:`~deepep_lightning.NaNRollbackCallback`: a failed check or a collapsed metric, and its fate.

An incident is checkpointed with the callback (``state_dict()["incidents"]``, loaded with
``weights_only=True``), so :meth:`Incident.to_dict` gives plain values under fixed keys and
:meth:`Incident.from_dict` reads them back; the same fields go into the health events of the incident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepep_lightning._enums import StrEnum

__all__ = ["Classification", "Incident", "Outcome"]


class Classification(StrEnum):
    """What the first replay of a failed step showed."""

    REPRODUCIBLE = "reproducible"  # the same failure at the same step: a numerical bug
    NONDETERMINISTIC = "nondeterministic"  # a failure, but another one: the step is not reproducible


class Outcome(StrEnum):
    """How an incident ended."""

    TRANSIENT = "transient"  # the first replay was clean
    RECOVERED = "recovered"  # a replay after the policy was clean; a regression's rollback that held
    ROLLED_BACK = "rolled_back"  # a regression rolled back, the metric not yet seen to hold
    STOPPED = "stopped"  # gave up: weights at the last healthy snapshot, training stopped


@dataclass
class Incident:
    """A failed check (or a collapse of a monitored metric) and what the rollback did about it.

    Args:
        step: the bad step (for a collapse, the step it was detected at).
        reason: the :class:`~deepep_lightning.HealthReason` as a string, or ``"regression"``.
        detected_at: ``trainer.global_step`` when the failure was seen (the check's end).
        attempts: policy applications (for a collapse, rollbacks) so far.
        monitor: the monitored metric of a collapse; ``None`` for a failed check.
        value: the metric's value at the collapse.
        best: the metric's best value before the collapse.
        best_step: the step of ``best``.
        classification: what the first replay showed; ``None`` before one failed.
        diagnosed: whether the non-finite locator ran (its report may still be ``None``).
        diagnosis: the locator's report (the op, module, phase...); ``None`` when it found no op.
        outcome: how it ended; ``None`` while open.
        recovered_at: the step a collapse was seen to be over.

    Example::

        incident = Incident(step=7, reason="nonfinite_loss", detected_at=8)
        assert Incident.from_dict(incident.to_dict()) == incident
    """

    step: int
    reason: str
    detected_at: int
    attempts: int = 0
    monitor: str | None = None
    value: float | None = None
    best: float | None = None
    best_step: int | None = None
    classification: Classification | None = None
    diagnosed: bool = False
    diagnosis: dict[str, Any] | None = None
    outcome: Outcome | None = None
    recovered_at: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The checkpointed form: plain values; a field that was never set has no key."""
        data: dict[str, Any] = {
            "step": self.step,
            "reason": self.reason,
            "detected_at": self.detected_at,
            "attempts": self.attempts,
        }
        if self.monitor is not None:
            data.update(monitor=self.monitor, value=self.value, best=self.best, best_step=self.best_step)
        if self.classification is not None:
            data["classification"] = self.classification.value
        if self.diagnosed:
            data["diagnosis"] = self.diagnosis
        if self.outcome is not None:
            data["outcome"] = self.outcome.value
        if self.recovered_at is not None:
            data["recovered_at"] = self.recovered_at
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Incident:
        """Read :meth:`to_dict`'s form back (keys it does not write are missing, not ``None``)."""
        classification = data.get("classification")
        outcome = data.get("outcome")
        return cls(
            step=int(data["step"]),
            reason=str(data["reason"]),
            detected_at=int(data.get("detected_at", data["step"])),
            attempts=int(data.get("attempts", 0)),
            monitor=data.get("monitor"),
            value=data.get("value"),
            best=data.get("best"),
            best_step=data.get("best_step"),
            classification=Classification(classification) if classification is not None else None,
            diagnosed="diagnosis" in data,
            diagnosis=data.get("diagnosis"),
            outcome=Outcome(outcome) if outcome is not None else None,
            recovered_at=data.get("recovered_at"),
        )

    def event_fields(self) -> dict[str, Any]:
        """The fields a health event about this incident carries: :meth:`to_dict` with ``step`` as ``incident_step``."""
        data = self.to_dict()
        step = data.pop("step")
        return data | {"incident_step": step}
