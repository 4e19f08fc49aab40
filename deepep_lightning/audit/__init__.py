"""deepep_lightning.audit: the L1–L4 determinism pyramid, the first-divergent-op and non-finite locators."""

from deepep_lightning.audit.nonfinite import DEFAULT_ALLOW_INF_OPS, NonFiniteOp, locate_nonfinite

__all__ = ["DEFAULT_ALLOW_INF_OPS", "NonFiniteOp", "locate_nonfinite"]
