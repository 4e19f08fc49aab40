"""deepep_lightning: reproducible, NaN-survivable PyTorch Lightning training.

Names are imported lazily, so ``deepep-compare`` and friends start without importing Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

from deepep_lightning._version import __version__

_EXPORTS = {
    "DeepEPModule": "deepep_lightning.module",
    "compare_runs": "deepep_lightning.compare",
    "CompareResult": "deepep_lightning.compare",
    "NumericalHealthCallback": "deepep_lightning.health",
    "NaNRollbackCallback": "deepep_lightning.health",
    "FaultInjectionCallback": "deepep_lightning.health",
    "LossSpikeDetector": "deepep_lightning.health",
    "NonFiniteError": "deepep_lightning.health",
    "CorruptSnapshotError": "deepep_lightning.health",
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
