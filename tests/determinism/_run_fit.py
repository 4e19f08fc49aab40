"""Test helper: one ``fit`` in a fresh process, optionally SIGKILLed after a checkpoint, or resumed.

Usage (from the tests)::

    python _run_fit.py --module plain --out DIR --tb DIR [--kill-at N] [--resume CKPT [--strip-resume-state W]]

Writes ``DIR/final.pt`` (model and optimizer state) when ``fit`` returns. Checkpoints go to
``DIR/last.ckpt`` every ``--ckpt-every`` steps (atomically: written to a temp name, then renamed).
With ``--kill-at N`` the process SIGKILLs itself at the start of the batch after global step ``N``
(loggers flushed first, so the logged scalars up to step ``N`` are on disk), i.e. mid-epoch and
``N - last checkpoint`` steps after the last checkpoint: the resumed run replays those steps.
``--unit batch`` makes both count batches instead of optimizer steps (with ``--accumulate``, a
checkpoint or a kill inside an accumulation window). ``--model-checkpoint`` adds Lightning's
``ModelCheckpoint(save_last=True)``, which writes ``DIR/last.ckpt`` at every validation end.

The plain module's patterns: ``--loader stateful`` (torchdata's ``StatefulDataLoader``),
``--datamodule`` (the loaders come from a ``LightningDataModule``), ``--accumulate N``,
``--val-check-interval`` (an int or a float), ``--scheduler`` (``onecycle``, ``warmup_cosine`` as one
``LambdaLR``, ``warmup_cosine_sequential`` as ``SequentialLR``; all ``interval="step"`` and sized by
``trainer.estimated_stepping_batches``).

Preemption: ``--signal-at N --signal NAME`` sends the process that signal (a real ``os.kill``) at the
start of the batch after global step ``N``; ``--preemption`` adds
:class:`~deepep_lightning.PreemptionCallback` writing ``DIR/last.ckpt`` (without it, Lightning's own
SIGTERM handling runs).

Negative controls: ``--strip-resume-state`` resumes from a copy of the checkpoint without part of
the state an exact resume needs (see :func:`_stripped_copy`); ``--skip-pending-loader-states``
leaves the loader states Lightning drops when the loader is built before the restore;
``--no-seekable-data`` leaves the train loader as it is (a ``StatefulDataLoader`` keeps its own state).

``--then ARGS...`` (repeatable) runs another fit with its own arguments in the same process once the fit
before it has returned; each fit starts from ``configure`` and builds its own module, callbacks and Trainer.
A fit that kills or signals the process ends the chain.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from tests._chained_fits import chained_fits  # noqa: E402

torch.set_num_threads(1)

from deepep_lightning.determinism import DeterminismCallback, configure  # noqa: E402

SEED = 1234


class _PlainDataset(torch.utils.data.Dataset):
    """64 fixed points; ``__getitem__`` augments with torch *and* numpy noise (worker-side randomness)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 6, generator=generator)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        import numpy as np

        noise = torch.randn(6) * 0.1 + torch.from_numpy(np.random.uniform(-0.05, 0.05, 6)).float()
        return self.x[index] + noise, self.y[index]


def _train_loader(kind: str):
    """The shuffled 2-worker train loader: a torch ``DataLoader`` or torchdata's ``StatefulDataLoader``."""
    loader_class = torch.utils.data.DataLoader
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader_class = StatefulDataLoader
    return loader_class(_PlainDataset(), batch_size=8, shuffle=True, num_workers=2)


def _val_loader():
    return torch.utils.data.DataLoader(_PlainDataset(), batch_size=16, shuffle=False)


def _schedulers(optimizer, scheduler: str, total_steps: int):
    """The step-interval LR scheduler named ``scheduler``, sized by ``total_steps`` optimizer steps."""
    import math

    warmup = max(1, total_steps // 6)
    if scheduler == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=total_steps)
    if scheduler == "warmup_cosine":  # linear warm-up, then cosine decay to 0, as one LambdaLR

        def warmup_then_cosine(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine)
    # "warmup_cosine_sequential": the same shape from torch's building blocks
    linear = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=warmup)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps - warmup)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [linear, cosine], milestones=[warmup])


def _plain_module(scheduler: str = "none", loader: str = "dataloader", with_loaders: bool = True):
    import lightning.pytorch as pl

    class PlainModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.log("train/loss", loss, on_step=True, on_epoch=False)
            # an epoch-level mean accumulates across the restart (Lightning checkpoints its results)
            self.log("train/epoch_loss", loss, on_step=False, on_epoch=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            # consumes the global RNG: must not shift the training stream
            loss = torch.nn.functional.cross_entropy(self.net(x + torch.randn_like(x)), y)
            self.log("val/loss", loss)

        def configure_optimizers(self):
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-2)
            if scheduler == "none":
                return optimizer
            # Lightning's recommended sizing: reading estimated_stepping_batches here builds the train
            # loader before the checkpoint is restored
            total_steps = int(self.trainer.estimated_stepping_batches)
            lr_scheduler = _schedulers(optimizer, scheduler, total_steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "interval": "step"}}

    class PlainModuleWithLoaders(PlainModule):
        def train_dataloader(self):
            return _train_loader(loader)

        def val_dataloader(self):
            return _val_loader()

    return PlainModuleWithLoaders() if with_loaders else PlainModule()


def _plain_datamodule(loader: str):
    """The same loaders from a LightningDataModule (the module then defines none)."""
    import lightning.pytorch as pl

    class PlainDataModule(pl.LightningDataModule):
        def train_dataloader(self):
            return _train_loader(loader)

        def val_dataloader(self):
            return _val_loader()

    return PlainDataModule()


def _deepep_module(extra_args: str):
    import json

    from deepep_lightning.deepep import DeepEPModule
    from deepep_lightning.deepep.config import grouped

    kwargs = {
        "name": "cartpole",
        "num_envs": 4,
        "rollout_length": 6,
        "hidden_size": 8,
        "steps_per_epoch": 7,
        "seed": SEED,
        "fused_value_head": False,
        **json.loads(extra_args),
    }
    return DeepEPModule(**grouped(**kwargs))


def _stripped_copy(path: str, state_key: str, what: str) -> str:
    """A copy of the checkpoint at ``path`` without the resume state named by ``what``.

    ``all``: the RNG states, the logging state and every train-loader position; ``rng``: the RNG
    states; ``loader``: the train-loader positions; ``gradients``: the gradients of an unfinished
    accumulation window.
    """
    checkpoint = torch.load(path, weights_only=False)
    state = checkpoint["callbacks"][state_key]
    state.pop("digest")  # an edit on purpose: without the digest the state is taken as it is
    if what in ("all", "rng"):
        state.pop("rng")
    if what == "all":
        state.pop("logged")
    if what in ("all", "loader"):
        assert state.pop("train_loaders", None) or checkpoint["loops"]["fit_loop"]["state_dict"].get("combined_loader")
        checkpoint["loops"]["fit_loop"]["state_dict"].pop("combined_loader", None)
    if what == "gradients":
        assert state.pop("accumulated_gradients"), "the checkpoint holds no unfinished accumulation window"
    stripped = path + ".stripped"
    torch.save(checkpoint, stripped)
    return stripped


def _val_check_interval(value: str) -> int | float:
    return float(value) if "." in value else int(value)


def main() -> None:
    segments = chained_fits(sys.argv[1:])
    for segment in segments:
        _fit(segment)


def _fit(argv: list[str]) -> None:
    """One fit with the arguments ``argv``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--module", choices=["plain", "deepep"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tb", required=True)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--max-epochs", type=int, default=None, help="with --max-steps -1: an epoch-sized run")
    parser.add_argument(
        "--scheduler", choices=["none", "onecycle", "warmup_cosine", "warmup_cosine_sequential"], default="none"
    )
    parser.add_argument("--loader", choices=["dataloader", "stateful"], default="dataloader", help="train loader class")
    parser.add_argument("--datamodule", action="store_true", help="the loaders come from a LightningDataModule")
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    parser.add_argument("--val-check-interval", type=_val_check_interval, default=None, help="int or float")
    parser.add_argument(
        "--skip-pending-loader-states",
        action="store_true",
        help="negative control: leave the loader states Lightning drops when the loader is built early",
    )
    parser.add_argument("--no-seekable-data", action="store_true", help="DeterminismCallback(seekable_data=False)")
    parser.add_argument("--unit", choices=["step", "batch"], default="step", help="what --ckpt-every/--kill-at count")
    parser.add_argument("--ckpt-every", type=int, default=3, help="0: no checkpoints from this script")
    parser.add_argument(
        "--model-checkpoint", action="store_true", help="Lightning's ModelCheckpoint(save_last=True) also saves"
    )
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--signal-at", type=int, default=None, help="send --signal at the batch after this step")
    parser.add_argument("--signal", default="SIGTERM", help="the signal --signal-at sends")
    parser.add_argument("--preemption", action="store_true", help="add PreemptionCallback (DIR/last.ckpt)")
    parser.add_argument("--resume", default=None)
    parser.add_argument(
        "--strip-resume-state",
        choices=["all", "rng", "loader", "gradients"],
        default=None,
        help="negative control: resume without that part of the resume state (see _stripped_copy)",
    )
    parser.add_argument("--no-reseed", action="store_true", help="rely on checkpointed RNG state only")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--deepep-args", default="{}", help="JSON of DeepEPModule arguments (GPU settings)")
    args = parser.parse_args(argv)

    configure(SEED, cublas_workspace_config=":4096:8")  # first thing: before CUDA starts

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    def position(trainer: pl.Trainer) -> int:
        """Optimizer steps, or batches, done before the current batch (what --kill-at and --ckpt-every count)."""
        return trainer.global_step if args.unit == "step" else trainer.fit_loop.total_batch_idx

    class CheckpointThenKill(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            done = trainer.global_step if args.unit == "step" else trainer.fit_loop.total_batch_idx + 1
            if args.ckpt_every > 0 and done % args.ckpt_every == 0:
                path = os.path.join(args.out, "last.ckpt")
                trainer.save_checkpoint(path + ".tmp")
                os.replace(path + ".tmp", path)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if args.signal_at is not None and position(trainer) == args.signal_at:
                os.kill(os.getpid(), getattr(signal, args.signal))
            if args.kill_at is not None and position(trainer) == args.kill_at:
                for logger in trainer.loggers:
                    logger.experiment.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    callback = DeterminismCallback(SEED, reseed_every_step=not args.no_reseed, seekable_data=not args.no_seekable_data)
    resume = args.resume
    if resume is not None and args.strip_resume_state is not None:
        resume = _stripped_copy(resume, callback.state_key, args.strip_resume_state)
    from deepep_lightning import _lightning_compat

    load_pending_loader_states = _lightning_compat.load_pending_loader_states
    if args.skip_pending_loader_states:  # for this fit only
        _lightning_compat.load_pending_loader_states = lambda trainer: False
    configure(SEED)  # before the model is built (and before CUDA starts): its initial weights are seeded
    if args.module == "plain":
        model = _plain_module(args.scheduler, args.loader, with_loaders=not args.datamodule)
    else:
        model = _deepep_module(args.deepep_args)
    datamodule = _plain_datamodule(args.loader) if args.datamodule else None
    callbacks: list[pl.Callback] = [callback, CheckpointThenKill()]
    if args.preemption:
        from deepep_lightning.checkpointing import PreemptionCallback

        callbacks.append(PreemptionCallback(checkpoint_path=os.path.join(args.out, "last.ckpt")))
    if args.scheduler != "none":
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if args.model_checkpoint:  # saves last.ckpt at every validation end, mid-epoch ones included
        callbacks.append(ModelCheckpoint(dirpath=args.out, save_last=True))
    if args.val_check_interval is not None:
        val_check_interval = args.val_check_interval
    else:
        val_check_interval = 4 if args.module == "plain" else 1.0
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        logger=TensorBoardLogger(args.tb, name="", version=""),
        log_every_n_steps=1,
        val_check_interval=val_check_interval,
        num_sanity_val_steps=2 if args.module == "plain" else 0,
        limit_val_batches=2,
        accumulate_grad_batches=args.accumulate,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=args.model_checkpoint,
    )
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=resume)
    finally:
        _lightning_compat.load_pending_loader_states = load_pending_loader_states
    optimizer_state = trainer.optimizers[0].state_dict()["state"]
    flat_optimizer = {f"opt.{i}.{k}": v for i, s in optimizer_state.items() for k, v in s.items()}
    torch.save({"model": model.state_dict(), "optimizer": flat_optimizer}, os.path.join(args.out, "final.pt"))


if __name__ == "__main__":
    sys.exit(main())
