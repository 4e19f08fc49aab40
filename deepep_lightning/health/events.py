"""Health events: one JSON object per line in the run's log directory, a line in the terminal, text in TensorBoard.

Every event is printed on rank 0 through Lightning's ``rank_zero_info`` (the ``lightning.pytorch``
logger, which Lightning shows by default), as one line: ``deepep_lightning health: step 18: detected
...``. The plugin's own loggers (``logging.getLogger("deepep_lightning")`` and its children) carry
debug details only, such as which event file a run writes; they have no handler unless you add one.
Scalars (event counts, norms) are not written here: the callbacks log them through
``LightningModule.log`` at their checks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from enum import Enum
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only

from deepep_lightning._enums import StrEnum

__all__ = ["DEFAULT_EVENTS_FILENAME", "INCIDENT_KINDS", "EventKind", "HealthEventLog", "describe_event", "run_log_dir"]

log = logging.getLogger(__name__)

#: The JSON-lines event log's name inside the run's log directory.
DEFAULT_EVENTS_FILENAME = "health_events.jsonl"


class EventKind(StrEnum):
    """The ``kind`` of a health event."""

    DETECTED = "detected"  # a check failed
    SPIKE_IGNORED = "spike_ignored"  # a loss spike, with rollback_on_spike=False
    LARGE_PARAM = "large_param"  # max |w| > param_max_abs at an epoch end
    ROLLBACK = "rollback"  # a snapshot restored, a replay starts
    TRANSIENT = "transient"  # the first replay was clean
    RECOVERED = "recovered"  # a replay after a policy was clean
    REPRODUCIBLE = "reproducible"  # the replay failed the same way
    NONDETERMINISTIC = "nondeterministic"  # the replay failed otherwise
    DIAGNOSIS = "diagnosis"  # the non-finite locator's report
    POLICY = "policy"  # skip or lower_lr applied
    STOPPED = "stopped"  # rollback gave up; training stops
    CORRUPT_SNAPSHOT = "corrupt_snapshot"  # a snapshot file failed verification
    REGRESSION = "regression"  # a monitored metric collapsed from its best


#: The kinds that count as a failed check (an incident): what ``health/incidents`` counts.
INCIDENT_KINDS = frozenset({EventKind.DETECTED.value, EventKind.REGRESSION.value, EventKind.LARGE_PARAM.value})

#: The longest terminal line of one event; the JSON-lines file keeps every field.
_MAX_LINE = 240


def _jsonable(value: Any) -> Any:
    if isinstance(value, Enum):
        return _jsonable(value.value)
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no NaN/Infinity; keep them readable
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def run_log_dir(trainer: pl.Trainer) -> str:
    """The run's log directory: the logger's ``log_dir`` when there is one, else ``default_root_dir``."""
    for logger in trainer.loggers:
        directory = getattr(logger, "log_dir", None)
        if directory:
            return directory
    return trainer.default_root_dir


def describe_event(event: dict[str, Any]) -> str:
    """One terminal line for an event: ``step 18: detected reason=nonfinite_loss details={...}``."""
    fields = " ".join(f"{k}={v}" for k, v in event.items() if k not in ("kind", "step", "time") and v is not None)
    line = f"step {event['step']}: {event['kind']}" + (f" {fields}" if fields else "")
    return line if len(line) <= _MAX_LINE else line[: _MAX_LINE - 3] + "..."


class HealthEventLog:
    """Collects events; rank 0 appends them to ``<log_dir>/<filename>``, prints them and adds them to TensorBoard.

    Args:
        filename: name of the JSON-lines file inside the run's log directory.
    """

    def __init__(self, filename: str = DEFAULT_EVENTS_FILENAME) -> None:
        self.filename = filename
        self.events: list[dict[str, Any]] = []
        self.path: str | None = None
        self._counted = 0  # events already counted by the last call of new_since_last_count()

    def attach(self, trainer: pl.Trainer) -> None:
        """Pick this run's file: ``<log_dir>/<filename>``, or ``<stem>.<n><suffix>`` when another run wrote that one.

        Called again by the same log (a second ``fit`` of the same callbacks), it keeps its file.
        """
        directory = run_log_dir(trainer)
        if self.path is not None and os.path.dirname(self.path) == directory:
            return
        stem, suffix = os.path.splitext(self.filename)
        path, index = os.path.join(directory, self.filename), 0
        while os.path.exists(path):
            index += 1
            path = os.path.join(directory, f"{stem}.{index}{suffix}")
        if index:
            log.debug("health events of this run go to %s (%s belongs to another run)", path, self.filename)
        self.path = path

    def emit(
        self, trainer: pl.Trainer | None, kind: EventKind, step: int, announce: bool = True, **fields: Any
    ) -> dict[str, Any]:
        """Record one event of ``kind`` at ``step``; enum values are written as their strings.

        Args:
            announce: print it on rank 0 (``rank_zero_info``); False where the caller warns with its own message.
        """
        event = _jsonable({"kind": kind, "step": int(step), "time": time.time(), **fields})
        self.events.append(event)
        if announce:
            rank_zero_info(f"deepep_lightning health: {describe_event(event)}")
        if trainer is not None:
            self._write(trainer, event)
        return event

    def count(self, *kinds: str) -> int:
        """How many events of these kinds were recorded (every kind when none is given)."""
        return sum(1 for event in self.events if not kinds or event["kind"] in kinds)

    def new_since_last_count(self) -> int:
        """Events recorded since the previous call (all of them at the first call)."""
        new, self._counted = len(self.events) - self._counted, len(self.events)
        return new

    @rank_zero_only
    def _write(self, trainer: pl.Trainer, event: dict[str, Any]) -> None:
        if self.path is None:
            self.attach(trainer)
        assert self.path is not None
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(event, sort_keys=True) + "\n")
        kind, step = event["kind"], event["step"]
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                text = "\n".join(f"- **{k}**: `{v}`" for k, v in event.items())
                logger.experiment.add_text(f"health/{kind}", text, global_step=step)
