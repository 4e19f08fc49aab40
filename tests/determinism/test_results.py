"""Tests for ``deepep_lightning/determinism/results.py``: epoch-level logs survive a mid-epoch resume."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torchmetrics.aggregation import MeanMetric

from deepep_lightning.determinism import DeterminismCallback, derive_seed


class _EpochLogger(pl.LightningModule):
    """Logs an epoch mean through Lightning's accumulator and through a torchmetrics Metric."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.metric = MeanMetric()
        self.epoch_values: dict[str, list[float]] = {"lightning": [], "metric": []}

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).pow(2).mean()
        self.log("epoch_loss", loss, on_step=False, on_epoch=True)
        self.metric.update(loss.detach() * (batch_idx + 1))
        self.log("epoch_metric", self.metric, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self) -> None:
        metrics = self.trainer.callback_metrics
        self.epoch_values["lightning"].append(float(metrics["epoch_loss"]))
        self.epoch_values["metric"].append(float(metrics["epoch_metric"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        data = torch.randn(24, 2, generator=torch.Generator().manual_seed(derive_seed(0, "data")))
        return torch.utils.data.DataLoader(data, batch_size=4)


class _SaveAt(pl.Callback):
    def __init__(self, path, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def _fit(quiet_trainer, max_steps: int, callbacks: list, ckpt=None) -> _EpochLogger:
    torch.manual_seed(0)  # same initial weights in every fit of this process
    model = _EpochLogger()
    trainer = quiet_trainer(
        max_steps=max_steps,
        callbacks=callbacks,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, ckpt_path=ckpt)
    return model


@pytest.mark.parametrize("restore", [True, False], ids=["restored", "negative_control"])
def test_epoch_means_continue_across_a_mid_epoch_resume(tmp_path, restore: bool, quiet_trainer) -> None:
    full = _fit(quiet_trainer, 12, [DeterminismCallback(0)])
    path = tmp_path / "mid.ckpt"
    _fit(quiet_trainer, 12, [DeterminismCallback(0), _SaveAt(path, 9)])  # epoch 1 (6 batches/epoch), batch 3
    if not restore:  # a checkpoint without the logging snapshot
        checkpoint = torch.load(path, weights_only=False)
        checkpoint["callbacks"][DeterminismCallback(0).state_key].pop("logged")
        checkpoint["callbacks"][DeterminismCallback(0).state_key].pop("digest")  # edited on purpose
        torch.save(checkpoint, path)
    resumed = _fit(quiet_trainer, 12, [DeterminismCallback(0)], ckpt=path)
    # the resumed process logs only the epoch it finished: epoch 1
    same = {name: resumed.epoch_values[name][-1] == full.epoch_values[name][1] for name in full.epoch_values}
    assert same == ({"lightning": True, "metric": True} if restore else {"lightning": False, "metric": False})
