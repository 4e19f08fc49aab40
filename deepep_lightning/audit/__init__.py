"""deepep_lightning.audit: the L1–L4 determinism pyramid, the first-divergent-op and non-finite locators."""

from deepep_lightning.audit.catalogue import CATALOGUE, catalogue_names
from deepep_lightning.audit.hashing import tensor_hash
from deepep_lightning.audit.level1 import audit_callable, audit_catalogue, format_catalogue_table
from deepep_lightning.audit.level2_3 import audit_module, locate_divergence
from deepep_lightning.audit.level4 import audit_training, compare_states
from deepep_lightning.audit.nonfinite import DEFAULT_ALLOW_INF_OPS, NonFiniteOp, locate_nonfinite
from deepep_lightning.audit.op_hashes import Divergence, OpHashMode, first_divergence, locate
from deepep_lightning.audit.repeat import RepeatStats, run_repeats
from deepep_lightning.audit.report import AuditReport, LevelResult
from deepep_lightning.audit.targets import ModuleTarget

__all__ = [
    "CATALOGUE",
    "DEFAULT_ALLOW_INF_OPS",
    "AuditReport",
    "Divergence",
    "LevelResult",
    "ModuleTarget",
    "NonFiniteOp",
    "OpHashMode",
    "RepeatStats",
    "audit_callable",
    "audit_catalogue",
    "audit_module",
    "audit_training",
    "catalogue_names",
    "compare_states",
    "first_divergence",
    "format_catalogue_table",
    "locate",
    "locate_divergence",
    "locate_nonfinite",
    "run_repeats",
    "tensor_hash",
]
