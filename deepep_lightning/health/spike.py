"""Loss-spike detector: z-score of the loss against a window of recent healthy losses.

A spike is confirmed when ``persistence`` consecutive losses each lie more than
``z_threshold`` standard deviations above the window mean, after ``warmup``
losses have been seen. Spiking losses do not enter the window, so a spike does
not raise the bar for the next one — until a run of them outlasts the window:
``window`` spiking losses in a row are a new level of the loss (a policy that
collapsed, a new phase of training), not a spike, and the window restarts from
them, so the detector does not flag every later step against a level that is
gone. All state is plain Python, in ``state_dict``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from deepep_lightning import _checks

__all__ = ["LossSpikeDetector"]


class LossSpikeDetector:
    """Flags upward loss spikes.

    Args:
        window: how many recent healthy losses define "normal" (>= 2).
        z_threshold: how many standard deviations above the mean count as a spike (> 0).
        warmup: losses to observe before judging (defaults to ``window``; >= 2), so the
            fast early descent of the loss is never called a spike.
        persistence: consecutive spiking losses needed to confirm (>= 1); 1 reacts at once,
            larger values ignore one-step blips.

    Raises:
        MisconfigurationException: an argument is out of range.

    Example::

        detector = LossSpikeDetector(window=50, z_threshold=6.0, persistence=2)
        if detector.update(step, loss):
            print("spike started at", detector.spike_start)
    """

    def __init__(
        self, window: int = 100, z_threshold: float = 6.0, warmup: int | None = None, persistence: int = 1
    ) -> None:
        # named as NumericalHealthCallback's arguments, which pass straight through
        self.window: int = _checks.int_in_range(None, "spike_window", window, 2, 100_000)
        _checks.number(None, "spike_z_threshold", z_threshold, minimum=0, exclusive_minimum=True, finite=True)
        self.z_threshold = float(z_threshold)
        warmup = _checks.int_at_least(None, "spike_warmup", warmup, 2, allow_none=True)
        self.warmup: int = window if warmup is None else warmup
        self.persistence: int = _checks.int_at_least(None, "spike_persistence", persistence, 1)
        self._history: deque[float] = deque(maxlen=window)
        self._seen = 0
        self._run: list[int] = []  # steps of the current run of spiking losses
        self._run_losses: list[float] = []  # their losses (the new level, if the run outlasts the window)
        self.last_z: float | None = None

    @property
    def spike_start(self) -> int | None:
        """First step of the current run of spiking losses (None when not spiking)."""
        return self._run[0] if self._run else None

    def zscore(self, loss: float) -> float | None:
        if self._seen < self.warmup or len(self._history) < 2:
            return None
        mean = math.fsum(self._history) / len(self._history)
        var = math.fsum((x - mean) ** 2 for x in self._history) / (len(self._history) - 1)
        # floor the scale so a perfectly flat loss does not turn rounding noise into spikes
        std = max(math.sqrt(var), 1e-6 * max(abs(mean), 1.0))
        return (loss - mean) / std

    def update(self, step: int, loss: float) -> bool:
        """Feed the loss of ``step``; True when a spike is confirmed at this step."""
        if not math.isfinite(loss):
            raise ValueError(f"loss of step {step} is {loss!r}; non-finite losses are the finite checks' job")
        z = self.zscore(loss)
        self.last_z = z
        self._seen += 1
        if z is not None and z > self.z_threshold:
            self._run.append(int(step))
            self._run_losses.append(float(loss))
            if len(self._run) >= self.window:  # a new level, not a spike: judge against it from now on
                self._history = deque(self._run_losses, maxlen=self.window)
                self._run, self._run_losses = [], []
                return False
            return len(self._run) >= self.persistence
        self._run, self._run_losses = [], []
        self._history.append(float(loss))
        return False

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self._history),
            "seen": self._seen,
            "run": list(self._run),
            "run_losses": list(self._run_losses),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = deque(state.get("history", []), maxlen=self.window)
        self._seen = int(state.get("seen", len(self._history)))
        self._run = list(state.get("run", []))
        self._run_losses = [float(x) for x in state.get("run_losses", [])]
