"""What DeterminismCallback puts back on the first training batch after a resume.

``load_state_dict`` runs before the fit loop has its first batch, when the parameters may not hold
gradients yet and the epoch's logging has not started, so the checkpointed values wait in a
:class:`PendingResume` until ``on_train_batch_start``: the RNG states (the only mechanism when
``reseed_every_step=False``), the gradients of an accumulation window the checkpoint was written in
(:mod:`~deepep_lightning.determinism.accumulation`), and, on a mid-epoch resume, the accumulated
metric modules and epoch results (:mod:`~deepep_lightning.determinism.results`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from deepep_lightning.determinism.accumulation import restore_gradients
from deepep_lightning.determinism.results import restore_metric_modules
from deepep_lightning.determinism.rng import restore_rng_state

__all__ = ["PendingResume"]


@dataclass
class PendingResume:
    """Checkpointed values that wait for the first training batch after a resume (``None``: nothing pending)."""

    rng: dict[str, Any] | None = None
    gradients: dict[str, Any] | None = None
    logged: dict[str, Any] | None = None

    def load(self, state_dict: dict[str, Any]) -> None:
        """Take the RNG states, window gradients and logged values of the callback's ``state_dict``."""
        if state_dict.get("logged"):
            self.logged = state_dict["logged"]
        self.gradients = state_dict.get("accumulated_gradients")
        if "rng" in state_dict:
            self.rng = state_dict["rng"]
        else:
            rank_zero_info("DeterminismCallback: the checkpoint holds no RNG state; the RNGs are not restored")

    def apply(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> tuple[bool, dict[str, Any] | None]:
        """Put back what is pending, once; returns (window gradients restored, the epoch's results or None).

        The results are returned on a mid-epoch resume only (the checkpoint's epoch is the current one).
        """
        if self.rng is not None:
            skipped = restore_rng_state(self.rng)
            if skipped:
                rank_zero_warn(f"DeterminismCallback: could not restore {', '.join(skipped)}")
            self.rng = None
        window_restored = False
        if self.gradients is not None:  # the resume lands inside an accumulation window
            gradients, self.gradients = self.gradients, None
            missing = restore_gradients(pl_module, gradients)
            if missing:
                rank_zero_warn(f"DeterminismCallback: no parameter named {missing} to restore the gradient of")
            window_restored = True
        results = None
        if self.logged is not None:
            logged, self.logged = self.logged, None
            if logged.get("epoch") == trainer.current_epoch:  # mid-epoch resume: continue the epoch's sums
                missing = restore_metric_modules(pl_module, logged)
                if missing:
                    rank_zero_warn(f"DeterminismCallback: no Metric module named {missing} to restore")
                results = dict(logged.get("results", {}))
        return window_restored, results
