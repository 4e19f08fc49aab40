"""Accumulated states of the module's torchmetrics metrics, for snapshots.

A rollback replays steps that already ran once. ``self.log`` is silenced during a replay (the step
was logged the first time, see ``_replay.py``), but a ``torchmetrics`` metric that ``training_step``
updates directly (DeepEP's ``train/episode_return``) would count the replayed steps twice and its
epoch value would differ from a clean run's. Capturing the metrics' states with the snapshot and
putting them back on restore makes them equal again.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import Tensor
from torchmetrics import Metric

__all__: list[str] = []


def _metrics(pl_module: "pl.LightningModule") -> dict[str, Metric]:
    return {name: module for name, module in pl_module.named_modules() if isinstance(module, Metric)}


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_clone(item) for item in value]
    return value


def capture_metric_states(pl_module: "pl.LightningModule") -> dict[str, Any]:
    """Copies of every metric's accumulated state, keyed by its module path."""
    return {
        key: {
            "states": {name: _clone(getattr(metric, name)) for name in metric._defaults},
            "update_count": metric._update_count,
        }
        for key, metric in _metrics(pl_module).items()
    }


def restore_metric_states(pl_module: "pl.LightningModule", saved: dict[str, Any]) -> None:
    """Put the captured states back; a metric first seen after the capture starts over (reset)."""
    for key, metric in _metrics(pl_module).items():
        state = saved.get(key)
        if state is None:
            metric.reset()
            continue
        for name, value in state["states"].items():
            setattr(metric, name, _clone(value))
        metric._update_count = state["update_count"]
        metric._computed = None
