"""deepep_lightning.health: finite checks without host syncs, spike detection, rollback and replay, fault injection."""

from deepep_lightning.health.events import EventKind
from deepep_lightning.health.fault_injection import FaultInjectionCallback
from deepep_lightning.health.flags import HealthReason, StepFlags, StepRecord
from deepep_lightning.health.health_callback import NumericalHealthCallback
from deepep_lightning.health.incident import Incident
from deepep_lightning.health.regression import RegressionTrigger
from deepep_lightning.health.rollback import Classification, NaNRollbackCallback, Outcome
from deepep_lightning.health.sharded_layouts import SHARDABLE_OPTIMIZERS
from deepep_lightning.health.snapshot import CorruptSnapshotError, Snapshot, SnapshotRing
from deepep_lightning.health.spike import LossSpikeDetector
from deepep_lightning.health.verdict import HealthVerdict, NonFiniteError

__all__ = [
    "SHARDABLE_OPTIMIZERS",
    "Classification",
    "CorruptSnapshotError",
    "EventKind",
    "FaultInjectionCallback",
    "HealthReason",
    "HealthVerdict",
    "Incident",
    "LossSpikeDetector",
    "NaNRollbackCallback",
    "NonFiniteError",
    "NumericalHealthCallback",
    "Outcome",
    "RegressionTrigger",
    "Snapshot",
    "SnapshotRing",
    "StepFlags",
    "StepRecord",
]
