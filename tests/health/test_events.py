"""Health events reach the terminal: one line per event on rank 0, through Lightning's rank_zero_info.

In-process tests listen on the logger ``rank_zero_info`` writes to (pytest's capture owns the
terminal streams); the subprocess test sees the terminal as a user does (stderr of a fresh process).
"""

import logging
import os
import sys
import textwrap
from pathlib import Path

import pytest

from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback
from deepep_lightning.health.events import describe_event

from .conftest import fit


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def printed():
    """The messages of ``rank_zero_info``'s logger (``lightning.pytorch.utilities.rank_zero``) during the test."""
    handler, logger = _Lines(), logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def test_a_recovered_nan_is_printed_through_lightning(tmp_path, printed):
    health = NumericalHealthCallback(check_every_n_steps=1, spike_detection=False)
    callbacks = [FaultInjectionCallback("loss", steps=[5]), health, NaNRollbackCallback(snapshot_every_n_steps=2)]
    fit(tmp_path, callbacks, max_steps=8)
    health_lines = [line for line in printed if line.startswith("deepep_lightning health:")]
    assert health_lines[0].startswith("deepep_lightning health: step 5: detected reason=nonfinite_loss")
    assert any(line.startswith("deepep_lightning health: step 5: transient") for line in health_lines)
    assert len(health_lines) == len(health.events.events)


def test_a_clean_run_prints_no_health_line(tmp_path, printed):
    """Negative control: nothing to report, nothing printed (while Lightning's own lines are seen)."""
    fit(tmp_path, [NumericalHealthCallback(check_every_n_steps=1)], max_steps=4)
    assert not any("deepep_lightning health:" in line for line in printed)
    assert any("max_steps=4" in line for line in printed)


_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from health.conftest import fit
    from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback
    from deepep_lightning.summary import RunSummaryCallback
    health = NumericalHealthCallback(check_every_n_steps=1, spike_detection=False)
    callbacks = [FaultInjectionCallback("loss", steps=[{fault}]), health, NaNRollbackCallback(snapshot_every_n_steps=2),
                 RunSummaryCallback(["train/loss"])]
    fit({root!r}, callbacks, max_steps=8)
""")


def _terminal(run_process, tmp_path, fault):
    tests = str(Path(__file__).resolve().parents[1])
    script = _SCRIPT.format(tests=tests, fault=fault, root=str(tmp_path))
    result = run_process([sys.executable, "-c", script], env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.mark.slow
def test_terminal_of_a_fresh_process_shows_the_recovered_nan_and_the_summary(tmp_path, run_process):
    shown = _terminal(run_process, tmp_path / "fault", 5)
    assert "deepep_lightning health: step 5: detected" in shown and "step 5: transient" in shown
    assert "deepep_lightning: fit ended at step 8" in shown
    assert "health: 1 detected, 1 rolled back, 1 transient, 0 recovered, 0 stopped" in shown
    assert "train/loss=" in shown and "train/loss=n/a" not in shown
    # negative control: the step after max_steps never runs, so no incident and no health line
    clean = _terminal(run_process, tmp_path / "clean", 99)
    assert "deepep_lightning health:" not in clean and "health: 0 detected" in clean


def test_event_line_names_step_kind_and_fields_and_is_bounded():
    line = describe_event({"kind": "detected", "step": 18, "time": 1.0, "reason": "nonfinite_loss", "x": None})
    assert line == "step 18: detected reason=nonfinite_loss"
    assert len(describe_event({"kind": "diagnosis", "step": 1, "time": 0.0, "report": "y" * 1000})) == 240
