"""RunSummaryCallback: one line at the end of fit: log directory, tensorboard command, metrics, health events."""

import logging

import pytest
from health.conftest import fit
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.loggers import TensorBoardLogger

from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NonFiniteError, NumericalHealthCallback
from deepep_lightning.summary import RunSummaryCallback


@pytest.fixture
def printed():
    """Messages of ``rank_zero_info``'s logger during the test (pytest's capture owns the terminal streams)."""
    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, logger = Lines(logging.INFO), logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def test_summary_names_the_log_dir_the_command_the_metrics_and_the_health_events(tmp_path, printed):
    summary = RunSummaryCallback(["train/loss", "val/acc"])
    callbacks = [
        FaultInjectionCallback("loss", steps=[5]),
        NumericalHealthCallback(check_every_n_steps=1, spike_detection=False),
        NaNRollbackCallback(snapshot_every_n_steps=2),
        summary,
    ]
    logger = TensorBoardLogger(str(tmp_path), name="run")
    fit(tmp_path, callbacks, max_steps=8, logger=logger)
    lines = [line for line in printed if line.startswith("deepep_lightning: fit")]
    assert lines == [summary.last_summary]  # one line per run
    line = lines[0]
    assert line.startswith("deepep_lightning: fit ended at step 8")
    assert f"logs: {logger.log_dir} (tensorboard --logdir {logger.log_dir})" in line
    assert "train/loss=" in line and "train/loss=n/a" not in line
    assert "val/acc=n/a" in line  # not logged by the module
    assert "health: 1 detected, 1 rolled back, 1 transient, 0 recovered, 0 stopped" in line


def test_clean_run_without_logger_or_health_says_so(tmp_path, printed):
    summary = RunSummaryCallback()
    fit(tmp_path, [summary], max_steps=2)
    assert "logs: none (no logger)" in summary.last_summary
    assert "health: not checked" in summary.last_summary


def test_a_failed_fit_still_prints_its_summary(tmp_path, printed):
    summary = RunSummaryCallback()
    callbacks = [FaultInjectionCallback("loss", steps=[2]), NumericalHealthCallback(check_every_n_steps=1), summary]
    with pytest.raises(NonFiniteError):
        fit(tmp_path, callbacks, max_steps=6)
    assert summary.last_summary.startswith("deepep_lightning: fit failed at step 3 (NonFiniteError")
    assert "health: 1 detected, 0 rolled back" in summary.last_summary
    assert summary.last_summary in printed


@pytest.mark.parametrize("metrics", ["train/loss", [""], [3], 3])
def test_bad_metrics_are_refused_by_name(metrics):
    with pytest.raises(MisconfigurationException, match="metrics"):
        RunSummaryCallback(metrics)
