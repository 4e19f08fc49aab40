"""The plugin on a plain Lightning project: a LightningModule, a DataModule and the three callbacks.

Run it twice and compare, or kill it and resume it: the runs end bitwise equal.

    python examples/plain_lightning.py --out runs/example/a
    python examples/plain_lightning.py --out runs/example/b
    deepep-compare runs/example/a/tb runs/example/b/tb          # exit 0: identical

    python examples/plain_lightning.py --out runs/example/c --max-steps 30 &  # kill -9 it mid-epoch, then
    python examples/plain_lightning.py --out runs/example/c --resume           # resumes from last.ckpt
    deepep-compare runs/example/a/tb runs/example/c/tb          # exit 0: identical to the uninterrupted run

``--kill-at STEP`` makes the script SIGKILL itself at that step (what a preempted node does).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

import deepep_lightning as dl


class NoisyBlobs(Dataset):
    """Two Gaussian blobs; every read adds fresh noise (augmentation drawn in the worker)."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=generator)
        self.y = (self.x[:, :4].sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.1 * torch.randn(8), self.y[index]


class BlobData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 16, num_workers: int = 2) -> None:
        super().__init__()
        self.batch_size, self.num_workers = batch_size, num_workers

    def setup(self, stage: str) -> None:
        self.train_set, self.val_set = NoisyBlobs(512, seed=0), NoisyBlobs(128, seed=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, self.batch_size, num_workers=self.num_workers)


class Classifier(pl.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val/accuracy", (self.net(x).argmax(1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class KillAt(pl.Callback):
    """SIGKILL this process at the start of step ``step`` (loggers flushed first)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for logger in trainer.loggers:
                logger.save()
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="run directory (TensorBoard logs, checkpoints)")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--resume", action="store_true", help="resume from OUT/ckpt/last.ckpt")
    parser.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process at this step")
    parser.add_argument("--num-workers", type=int, default=2)
    args = parser.parse_args(argv)

    pl.seed_everything(args.seed, workers=True)  # before the model is built: its weights are seeded
    callbacks: list[pl.Callback] = [
        dl.DeterminismCallback(seed=args.seed),  # bitwise runs, RNG-complete checkpoints, exact resume
        dl.NumericalHealthCallback(check_every_n_steps=5),  # NaN/Inf and loss spikes, no per-step host sync
        dl.NaNRollbackCallback(snapshot_every_n_steps=10, snapshot_dir=str(args.out / "snapshots")),
        ModelCheckpoint(dirpath=args.out / "ckpt", save_last=True, every_n_train_steps=5, save_top_k=0),
    ]
    if args.kill_at is not None:
        callbacks.append(KillAt(args.kill_at))
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=args.max_steps,
        val_check_interval=20,
        log_every_n_steps=1,
        logger=TensorBoardLogger(args.out, name="tb", version=""),
        callbacks=callbacks,
        enable_model_summary=False,
    )
    last = args.out / "ckpt" / "last.ckpt"
    trainer.fit(
        Classifier(), datamodule=BlobData(num_workers=args.num_workers), ckpt_path=last if args.resume else None
    )


if __name__ == "__main__":
    main()
