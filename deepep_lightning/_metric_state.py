"""Accumulated states of a module's torchmetrics ``Metric`` submodules: capture and restore.

A metric's states are not persistent by default (not in ``state_dict``), yet they decide its epoch
value. Two places need them exact:

* a rollback replays steps that already ran once; a ``Metric`` that ``training_step`` updates
  directly (``self.log`` is silenced during a replay) would count them twice, so the health
  snapshot captures the states and puts them back (:mod:`deepep_lightning.health.snapshot`);
* a mid-epoch resume must start the epoch's metrics where the checkpoint left them
  (:mod:`deepep_lightning.determinism.results`).

States are copied (a list state item by item) and keyed by the metric's module path.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torchmetrics import Metric

from deepep_lightning._lightning_compat import metric_state_names, metric_update_count, set_metric_update_count

__all__ = ["capture_metric_states", "restore_metric_states"]


def _metrics(pl_module: pl.LightningModule) -> dict[str, Metric]:
    return {name: module for name, module in pl_module.named_modules() if name and isinstance(module, Metric)}


def _copy(value: Any, device: torch.device | str | None) -> Any:
    if isinstance(value, Tensor):
        value = value.detach()
        return value.clone() if device is None else value.to(device, copy=True)
    if isinstance(value, list):
        return [_copy(item, device) for item in value]
    return value


def _device_of(value: Any) -> torch.device | None:
    if isinstance(value, Tensor):
        return value.device
    if isinstance(value, list) and value and isinstance(value[0], Tensor):
        return value[0].device
    return None


def capture_metric_states(pl_module: pl.LightningModule, device: torch.device | str | None = None) -> dict[str, Any]:
    """``{module path: {"states": {name: copy}, "update_count": int}}`` for every ``Metric`` submodule.

    Args:
        pl_module: the module whose metrics to capture.
        device: where the copies go (``"cpu"`` for a checkpoint); None keeps each state's device.

    Example::

        saved = capture_metric_states(model, device="cpu")
        restore_metric_states(model, saved)  # the metrics' epoch values are those of the capture
    """
    return {
        key: {
            "states": {name: _copy(getattr(metric, name), device) for name in metric_state_names(metric)},
            "update_count": metric_update_count(metric),
        }
        for key, metric in _metrics(pl_module).items()
    }


def restore_metric_states(
    pl_module: pl.LightningModule, saved: dict[str, Any], reset_missing: bool = False
) -> list[str]:
    """Put captured states back, each on the device of the live state; returns saved paths with no metric now.

    Args:
        pl_module: the module whose metrics to restore.
        saved: what :func:`capture_metric_states` returned.
        reset_missing: reset metrics the capture does not hold (created after it), so they start over.
    """
    metrics = _metrics(pl_module)
    for key, metric in metrics.items():
        entry = saved.get(key)
        if entry is None:
            if reset_missing:
                metric.reset()
            continue
        for name, value in entry["states"].items():
            current = getattr(metric, name, None)
            setattr(metric, name, _copy(value, _device_of(current)))
        set_metric_update_count(metric, entry["update_count"])
    return [key for key in saved if key not in metrics]
