"""deepep_lightning: reproducible, NaN-survivable PyTorch Lightning training.

The reference workload, DeepEP, lives in :mod:`deepep_lightning.deepep` and is not re-exported here.

Importing the package registers ``strategy="ddp_deterministic"`` with Lightning (it imports
:mod:`deepep_lightning.strategies`); the other public names are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from deepep_lightning._version import __version__

_EXPORTS = {
    "compare_runs": "deepep_lightning.compare",
    "CompareResult": "deepep_lightning.compare",
    "NumericalHealthCallback": "deepep_lightning.health",
    "NaNRollbackCallback": "deepep_lightning.health",
    "RegressionTrigger": "deepep_lightning.health",
    "FaultInjectionCallback": "deepep_lightning.health",
    "LossSpikeDetector": "deepep_lightning.health",
    "NonFiniteError": "deepep_lightning.health",
    "CorruptSnapshotError": "deepep_lightning.health",
    "RunSummaryCallback": "deepep_lightning.summary",
    "PreemptionCallback": "deepep_lightning.checkpointing",
    "AtomicCheckpointIO": "deepep_lightning.checkpointing",
    "CheckpointWriteError": "deepep_lightning.checkpointing",
    "configure": "deepep_lightning.determinism",
    "ConfigureRecord": "deepep_lightning.determinism",
    "DeterminismCallback": "deepep_lightning.determinism",
    "FingerprintMismatchError": "deepep_lightning.determinism",
    "ShardingLayoutMismatchError": "deepep_lightning.determinism",
    "SeekableSampler": "deepep_lightning.determinism",
    "SeededDataset": "deepep_lightning.determinism",
    "SeekableDataLoader": "deepep_lightning.determinism",
    "capture_rng_state": "deepep_lightning.determinism",
    "restore_rng_state": "deepep_lightning.determinism",
    "collect_fingerprint": "deepep_lightning.determinism",
    "derive_seed": "deepep_lightning.determinism",
    "make_generator": "deepep_lightning.determinism",
    "DeterministicDDPStrategy": "deepep_lightning.strategies.deterministic_ddp",
    "WorldSizeMismatchError": "deepep_lightning.strategies.rank_state",
    "audit_callable": "deepep_lightning.audit.level1",
    "audit_catalogue": "deepep_lightning.audit.level1",
    "audit_module": "deepep_lightning.audit.level2_3",
    "audit_training": "deepep_lightning.audit.level4",
    "OpHashMode": "deepep_lightning.audit.op_hashes",
    "first_divergence": "deepep_lightning.audit.op_hashes",
    "ModuleTarget": "deepep_lightning.audit.targets",
    "AuditReport": "deepep_lightning.audit.report",
    "grid_sample": "deepep_lightning.ops",
    "interpolate": "deepep_lightning.ops",
    "patch_refused_ops": "deepep_lightning.ops",
    "extension_available": "deepep_lightning.ops",
    "locate_nonfinite": "deepep_lightning.audit.nonfinite",
    "NonFiniteOp": "deepep_lightning.audit.nonfinite",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'deepep_lightning' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


# Last: the strategy's modules import names from this package, which needs __getattr__ defined.
import deepep_lightning.strategies  # noqa: E402,F401  registers strategy="ddp_deterministic"
