"""Carry epoch-level logging accumulators across a mid-epoch restart.

Lightning 2.6 does not checkpoint its ``_ResultCollection`` (the running sums behind
``self.log(..., on_epoch=True)``) nor the state of torchmetrics ``Metric`` objects (their states
are not persistent by default). After a mid-epoch resume the epoch value is then computed from the
resumed part only. These helpers snapshot both as plain tensors and put them back:

* ``Metric`` submodules of the LightningModule: states restored as they were, before the first
  resumed batch updates them (:mod:`deepep_lightning._metric_state`);
* Lightning's own accumulators: created lazily by the first ``self.log`` of the resumed epoch, so
  the saved partial sum is *added* after that first update. Addition of two floats is commutative
  in IEEE arithmetic, so ``(0 + x) + saved == saved + x`` bit for bit: the epoch value is exact.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from deepep_lightning import _lightning_compat
from deepep_lightning._metric_state import capture_metric_states, restore_metric_states

__all__ = ["capture_logged_state", "restore_metric_modules", "merge_epoch_results"]


def capture_logged_state(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Any]:
    """Snapshot of metric-module states and epoch accumulators (CPU tensors, ints, strings)."""
    metrics = capture_metric_states(pl_module, device="cpu")
    results: dict[str, dict[str, Any]] = {}
    for key, result in _lightning_compat.epoch_result_collection(trainer).items():
        if not getattr(result, "is_tensor", False) or not result.meta.on_epoch:
            continue
        entry = {"value": result.value.detach().cpu()}
        if result.meta.is_mean_reduction:
            entry["cumulated_batch_size"] = result.cumulated_batch_size.detach().cpu()
            entry["reduce"] = "mean"
        elif result.meta.is_max_reduction:
            entry["reduce"] = "max"
        elif result.meta.is_min_reduction:
            entry["reduce"] = "min"
        elif result.meta.is_sum_reduction:
            entry["reduce"] = "sum"
        else:
            continue  # custom reductions cannot be merged exactly
        results[key] = entry
    return {"epoch": int(trainer.current_epoch), "metrics": metrics, "results": results}


def restore_metric_modules(pl_module: "pl.LightningModule", saved: dict[str, Any]) -> list[str]:
    """Put saved ``Metric`` states back; returns the names that could not be matched."""
    return restore_metric_states(pl_module, saved.get("metrics", {}))


def merge_epoch_results(trainer: "pl.Trainer", pending: dict[str, dict[str, Any]]) -> None:
    """Fold saved epoch accumulators into the live ones that exist now; merged keys leave ``pending``."""
    collection = _lightning_compat.epoch_result_collection(trainer)
    for key in [k for k in pending if k in collection]:
        entry, result = pending.pop(key), collection[key]
        saved = entry["value"].to(result.value.device, result.value.dtype)
        if entry["reduce"] in ("mean", "sum"):
            result.value = result.value + saved
            if entry["reduce"] == "mean":
                result.cumulated_batch_size = result.cumulated_batch_size + entry["cumulated_batch_size"].to(
                    result.cumulated_batch_size.device
                )
        elif entry["reduce"] == "max":
            result.value = torch.maximum(result.value, saved)
        else:
            result.value = torch.minimum(result.value, saved)
