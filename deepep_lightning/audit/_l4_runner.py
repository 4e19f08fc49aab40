"""L4 worker: one ``fit`` of a LightningModule in this (fresh) process, via LightningCLI.

``python -m deepep_lightning.audit._l4_runner --out DIR --steps K [--target pkg.mod:Class]
[--config FILE] [--data pkg.mod:DataModule] [--kill-at S] [--resume] [--determinism] [-- extra LightningCLI args]``

A DataModule (``--data``, or the config's ``data:`` section with a ``class_path``) is built by
LightningCLI from the config's ``data:`` init args and passed to ``fit`` as ``datamodule``.

Writes TensorBoard scalars to ``DIR/tb`` (every step), ``DIR/ckpt/last.ckpt`` after every step,
and ``DIR/final.pt`` (model state_dict, optimizer states, global step) when ``fit`` returns.
``--kill-at S`` SIGKILLs the process at the start of the batch after global step ``S`` (after its
checkpoint and with the logger flushed); ``--resume`` continues from ``DIR/ckpt/last.ckpt``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from deepep_lightning.audit.targets import DEEPEP_TARGET, load_class, load_data  # noqa: E402
from deepep_lightning.protocols import SequenceAuditable  # noqa: E402

__all__: list[str] = []


class _KillAt(Callback):
    """SIGKILL this process once ``global_step`` reaches ``step`` (a crash: no teardown, no final save)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step >= self.step:
            for logger in trainer.loggers:
                logger.save()
                experiment: Any = getattr(logger, "experiment", None)
                if hasattr(experiment, "flush"):
                    experiment.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def _config_has_callback(config: str | None, name: str) -> bool:
    """Whether the config's ``trainer.callbacks`` already holds a callback class called ``name``."""
    if config is None:
        return False
    with open(config, encoding="utf-8") as handle:
        data = yaml.safe_load(handle) or {}
    trainer = data.get("trainer") if isinstance(data, dict) else None
    entries = (trainer or {}).get("callbacks") or [] if isinstance(trainer, dict) else []
    entries = entries if isinstance(entries, list) else [entries]
    return any(isinstance(e, dict) and str(e.get("class_path", "")).rsplit(".", 1)[-1] == name for e in entries)


def _cli_config(config: str | None, tmp: str) -> str | None:
    """A LightningCLI file as is; a plain kwargs YAML is wrapped as its ``model`` section."""
    if config is None:
        return None
    with open(config, encoding="utf-8") as handle:
        data = yaml.safe_load(handle) or {}
    if isinstance(data, dict) and ({"model", "trainer", "seed_everything", "data"} & set(data)):
        return config
    wrapped = os.path.join(tmp, "model_config.yaml")
    with open(wrapped, "w", encoding="utf-8") as handle:
        yaml.safe_dump({"model": data}, handle)
    return wrapped


def _with_data_section(config: str | None, data: str | None, tmp: str) -> tuple[str | None, bool]:
    """The config with its ``data:`` section in LightningCLI's subclass form; whether there is a DataModule."""
    spec = load_data(data, config)
    if spec is None:
        return config, False
    loaded: dict[str, Any] = {}
    if config is not None:
        with open(config, encoding="utf-8") as handle:
            loaded = yaml.safe_load(handle) or {}
    loaded["data"] = {"class_path": spec.class_path, "init_args": spec.init_args}
    written = os.path.join(tmp, "data_config.yaml")
    with open(written, "w", encoding="utf-8") as handle:
        yaml.safe_dump(loaded, handle)
    return written, True


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEEPEP_TARGET)
    parser.add_argument("--config")
    parser.add_argument("--data")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--determinism", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model_class = load_class(args.target)
    callbacks: list[Callback] = []
    if args.determinism and not _config_has_callback(args.config, "DeterminismCallback"):
        from deepep_lightning.determinism import DeterminismCallback

        callbacks.append(DeterminismCallback(seed=args.seed))
    callbacks.append(
        ModelCheckpoint(
            dirpath=os.path.join(args.out, "ckpt"),
            every_n_train_steps=1,
            save_top_k=0,
            save_last=True,
            save_on_train_epoch_end=False,
        )
    )
    if args.kill_at is not None:
        callbacks.append(_KillAt(args.kill_at))
    # as train.py does for DeepEP: one seed for Lightning and the module's own streams
    seed_argument = model_class.seed_argument if isinstance(model_class, SequenceAuditable) else None

    class _CLI(LightningCLI):
        def add_arguments_to_parser(self, parser: Any) -> None:
            if seed_argument is not None:
                parser.link_arguments("seed_everything", f"model.{seed_argument}")

    with tempfile.TemporaryDirectory() as tmp:
        config, has_data = _with_data_section(_cli_config(args.config, tmp), args.data, tmp)
        cli_args = (
            (["--config", config] if config else [])
            + list(extra)
            + [
                f"--seed_everything={args.seed}",
                f"--trainer.max_steps={args.steps}",
                "--trainer.max_epochs=-1",
                "--trainer.devices=1",
                "--trainer.log_every_n_steps=1",
                "--trainer.enable_checkpointing=true",
                "--trainer.enable_progress_bar=false",
                "--trainer.enable_model_summary=false",
                f"--trainer.default_root_dir={args.out}",
                "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
                f"--trainer.logger.init_args.save_dir={args.out}",
                "--trainer.logger.init_args.name=tb",
                "--trainer.logger.init_args.version=0",
            ]
        )
        cli = _CLI(
            model_class,
            pl.LightningDataModule if has_data else None,
            subclass_mode_data=has_data,
            run=False,
            args=cli_args,
            trainer_defaults={"callbacks": callbacks},
            save_config_callback=None,
            seed_everything_default=args.seed,
        )
    last = os.path.join(args.out, "ckpt", "last.ckpt")
    cli.trainer.fit(cli.model, datamodule=cli.datamodule if has_data else None, ckpt_path=last if args.resume else None)
    torch.save(
        {
            "state_dict": {k: v.detach().cpu() for k, v in cli.model.state_dict().items()},
            "optimizers": [optimizer.state_dict() for optimizer in cli.trainer.optimizers],
            "global_step": cli.trainer.global_step,
        },
        os.path.join(args.out, "final.pt"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
