"""Epoch-level values after a rollback: replayed steps must not be counted twice."""

from __future__ import annotations

from torchmetrics import MeanMetric

from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback
from deepep_lightning.health import snapshot as snapshot_module

from .conftest import CaptureLogger, ToyModule, fit


class EpochLoggingModule(ToyModule):
    """Logs an epoch mean through ``self.log(on_epoch=True)`` and through a torchmetrics metric."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_mean = MeanMetric()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/epoch_loss", loss.detach(), on_step=False, on_epoch=True)
        self.loss_mean.update(loss.detach())
        self.log("train/metric_loss", self.loss_mean, on_step=False, on_epoch=True)
        return loss


def _epoch_values(tmp_path, faulty: bool) -> dict[str, float]:
    logger = CaptureLogger(str(tmp_path))
    callbacks = [NumericalHealthCallback(check_every_n_steps=1), NaNRollbackCallback(snapshot_every_n_steps=2)]
    if faulty:
        callbacks.insert(0, FaultInjectionCallback("gradient", steps=[5]))
    fit(tmp_path, callbacks, max_steps=8, module=EpochLoggingModule, logger=logger)
    tags = ("train/epoch_loss", "train/metric_loss")
    values = {key: value for _, metrics in logger.metrics for key, value in metrics.items() if key in tags}
    assert {"train/epoch_loss", "train/metric_loss"} <= values.keys()
    return values


def test_transient_fault_leaves_epoch_aggregates_equal(tmp_path):
    clean = _epoch_values(tmp_path / "clean", faulty=False)
    assert _epoch_values(tmp_path / "faulty", faulty=True) == clean


def test_without_restoring_metric_states_the_replay_is_counted_twice(tmp_path, monkeypatch):
    clean = _epoch_values(tmp_path / "clean", faulty=False)
    monkeypatch.setattr(snapshot_module, "restore_metric_states", lambda *args, **kwargs: None)  # negative control
    faulty = _epoch_values(tmp_path / "faulty", faulty=True)
    assert faulty["train/metric_loss"] != clean["train/metric_loss"]  # the torchmetrics mean saw steps twice
    assert faulty["train/epoch_loss"] == clean["train/epoch_loss"]  # self.log is silenced during replays


def test_snapshot_files_without_metric_states_still_load(tmp_path):
    import dataclasses

    fields = {f.name for f in dataclasses.fields(snapshot_module.Snapshot)}
    assert "metrics" in fields
    payload = {name: None for name in fields if not name.startswith("_") and name != "metrics"}
    payload.update(step=1, epoch=0, optimizers=[], schedulers=[], rng={}, progress={}, callback_state={}, lr_scale=1.0)
    assert snapshot_module.Snapshot(**payload).metrics == {}  # a file written before the field existed
