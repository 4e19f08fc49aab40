"""Health events: one JSON object per line in the run's log directory, mirrored to TensorBoard."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

__all__ = ["HealthEventLog"]

log = logging.getLogger(__name__)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no NaN/Infinity; keep them readable
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def run_log_dir(trainer: "pl.Trainer") -> str:
    """The run's log directory: the logger's ``log_dir`` when there is one, else ``default_root_dir``."""
    for logger in trainer.loggers:
        directory = getattr(logger, "log_dir", None)
        if directory:
            return directory
    return trainer.default_root_dir


class HealthEventLog:
    """Collects events; rank 0 appends them to ``<log_dir>/<filename>`` and to TensorBoard.

    Args:
        filename: name of the JSON-lines file inside the run's log directory.
    """

    def __init__(self, filename: str = "health_events.jsonl") -> None:
        self.filename = filename
        self.events: list[dict[str, Any]] = []
        self.path: str | None = None
        self._counts: dict[str, int] = {}

    def attach(self, trainer: "pl.Trainer") -> None:
        self.path = os.path.join(run_log_dir(trainer), self.filename)

    def emit(self, trainer: "pl.Trainer" | None, kind: str, step: int, **fields: Any) -> dict[str, Any]:
        """Record one event (``kind`` like ``"detected"``, ``"transient"``, ``"stopped"``) at ``step``."""
        event = _jsonable({"kind": kind, "step": int(step), "time": time.time(), **fields})
        self.events.append(event)
        self._counts[kind] = self._counts.get(kind, 0) + 1
        log.info("health event %s at step %d: %s", kind, step, fields)
        if trainer is not None:
            self._write(trainer, event)
        return event

    @rank_zero_only
    def _write(self, trainer: "pl.Trainer", event: dict[str, Any]) -> None:
        if self.path is None:
            self.attach(trainer)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(event, sort_keys=True) + "\n")
        kind, step = event["kind"], event["step"]
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                text = "\n".join(f"- **{k}**: `{v}`" for k, v in event.items())
                logger.experiment.add_text(f"health/{kind}", text, global_step=step)
            logger.log_metrics({f"health/events/{kind}": float(self._counts[kind])}, step=step)

    def log_scalars(self, trainer: "pl.Trainer", metrics: dict[str, float], step: int) -> None:
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
