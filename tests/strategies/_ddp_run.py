"""Test helper: one ``fit`` with ``strategy="ddp_deterministic"`` on CPU (gloo), in a fresh process.

Usage (from the tests)::

    python _ddp_run.py --out DIR [--devices 2] [--fault-rank R --fault-step S] [--save-ckpt] [--resume CKPT]

Lightning's subprocess launcher re-runs this script for ranks >= 1. Every rank writes
``DIR/rank{r}.json`` (its seeds, the sample indices it trained on per epoch, the first augmentation
noise it drew, rollback incidents, the strategy fingerprint) and ``DIR/weights_rank{r}.pt`` (its
final ``state_dict``); at interpreter exit, after the handlers the fit registered, ``DIR/exit_rank{r}.json``
records whether the process group was still alive. ``--save-ckpt`` writes ``DIR/last.ckpt`` at the end
(all ranks take part).
``--preemption`` adds :class:`~deepep_lightning.PreemptionCallback` writing ``DIR/last.ckpt``;
``--signal-rank R --signal-at N --signal NAME`` makes rank ``R`` alone send itself that signal at the
start of the batch after global step ``N``. A rank that leaves ``fit`` with an exception writes
``DIR/stopped_rank{r}.json`` (its global step and the ``SystemExit`` code).
The module draws augmentation noise from the global RNG, so per-rank seeds are visible in the
weights, and the health callbacks (snapshot, check, rollback) run in every 2-process run.

``--then ARGS...`` (repeatable, the same ``--devices``) fits again with its own arguments in the same
processes and process group once the fit before it is done, from ``seed_everything`` and a new Trainer;
the exit record goes to the first fit's directory only.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import deepep_lightning  # noqa: E402,F401  (the import registers strategy="ddp_deterministic")
from tests._chained_fits import fit_in_one_process_group  # noqa: E402

torch.set_num_threads(1)

SEED = 321
NUM_SAMPLES = 32
BATCH_SIZE = 4


class _IndexedDataset(torch.utils.data.Dataset):
    """Fixed regression points; the batch carries the sample indices so shards can be checked."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(NUM_SAMPLES, 8, generator=generator)
        self.y = self.x[:, :2].sum(1, keepdim=True).tanh()

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int):
        return self.x[index], self.y[index], index


def _module():
    import lightning.pytorch as pl

    class TinyModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.seen: dict[int, list[int]] = {}
            self.first_noise: float | None = None
            self.trace: list = []  # (step, loss, noise sum, indices) of every training_step call, replays included

        def on_train_batch_start(self, batch, batch_idx):
            self.seen.setdefault(self.current_epoch, []).extend(int(i) for i in batch[2])

        def training_step(self, batch, batch_idx):
            x, y, _ = batch
            noise = torch.randn_like(x) * 0.1  # augmentation from the (per-rank seeded) global RNG
            if self.first_noise is None:
                self.first_noise = float(noise[0, 0])
            loss = torch.nn.functional.mse_loss(self.net(x + noise), y)
            self.trace.append(
                [int(self.global_step), float(loss.detach()), float(noise.sum()), [int(i) for i in batch[2]]]
            )
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_IndexedDataset(), batch_size=BATCH_SIZE, shuffle=True)

    return TinyModule()


def _record_process_group_at_exit(path: str) -> None:
    # registered before fit, so atexit runs it after every handler the fit registers
    with open(path, "w") as handle:
        json.dump({"process_group_initialized": torch.distributed.is_initialized()}, handle)


def _signal_and_record_type():
    import lightning.pytorch as pl

    class SignalAndRecord(pl.Callback):
        """Sends this rank the signal at ``--signal-at``; records how the rank left ``fit`` on an exception."""

        def __init__(self, args: argparse.Namespace, rank: int) -> None:
            self.args, self.rank = args, rank

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.rank == self.args.signal_rank and trainer.global_step == self.args.signal_at:
                import signal

                os.kill(os.getpid(), getattr(signal, self.args.signal))

        def on_exception(self, trainer, pl_module, exception):
            code = exception.code if isinstance(exception, SystemExit) else repr(exception)
            with open(os.path.join(self.args.out, f"stopped_rank{self.rank}.json"), "w") as handle:
                json.dump({"global_step": trainer.global_step, "code": code}, handle)

    return SignalAndRecord


def _signal_and_record(args: argparse.Namespace, rank: int):
    return _signal_and_record_type()(args, rank)


def main(argv: list[str]) -> None:
    fit_in_one_process_group(argv, lambda arguments, index: _fit(arguments, record_exit=index == 0))


def _fit(argv: list[str], record_exit: bool) -> None:
    """One fit with the arguments ``argv``; ``record_exit``: write ``DIR/exit_rank{r}.json`` at exit."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--fault-rank", type=int, default=-1)
    parser.add_argument("--fault-step", type=int, default=5)
    parser.add_argument("--save-ckpt", action="store_true")
    parser.add_argument("--resume", default=None)
    parser.add_argument(
        "--no-health", action="store_true", help="without the health callbacks (they need accumulate=1)"
    )
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument("--determinism", action="store_true", help="add DeterminismCallback(seed=SEED)")
    parser.add_argument("--preemption", action="store_true", help="add PreemptionCallback (DIR/last.ckpt)")
    parser.add_argument("--signal-rank", type=int, default=-1)
    parser.add_argument("--signal-at", type=int, default=-1)
    parser.add_argument("--signal", default="SIGTERM")
    parser.add_argument("--strategy-kwargs", default=None, help="JSON: build the strategy object instead of the name")
    args = parser.parse_args(argv)

    import lightning.pytorch as pl

    from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback

    pl.seed_everything(SEED, verbose=False)
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by the launcher in ranks >= 1
    if record_exit:
        atexit.register(_record_process_group_at_exit, os.path.join(args.out, f"exit_rank{rank}.json"))
    rollback = NaNRollbackCallback(snapshot_every_n_steps=2, keep_snapshots=2, locate=False)
    callbacks = [NumericalHealthCallback(check_every_n_steps=1, spike_detection=False, log_norms=False), rollback]
    if args.no_health:
        callbacks = []
    fault = None
    if rank == args.fault_rank:
        fault = FaultInjectionCallback("gradient", steps=[args.fault_step], mode="once")
        callbacks.append(fault)
    if args.determinism:
        from deepep_lightning.determinism import DeterminismCallback

        callbacks.append(DeterminismCallback(seed=SEED, log_fingerprint=False))
    if args.preemption:
        from deepep_lightning.checkpointing import PreemptionCallback

        callbacks.append(PreemptionCallback(checkpoint_path=os.path.join(args.out, "last.ckpt")))
    if args.preemption or args.signal_rank >= 0:
        callbacks.append(_signal_and_record(args, rank))
    model = _module()
    strategy_arg = "ddp_deterministic"
    if args.strategy_kwargs:
        from deepep_lightning.strategies import DeterministicDDPStrategy

        strategy_arg = DeterministicDDPStrategy(**json.loads(args.strategy_kwargs))
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy_arg,
        max_epochs=args.max_epochs,
        callbacks=callbacks,
        accumulate_grad_batches=args.accumulate,
        logger=False,
        default_root_dir=args.out,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, ckpt_path=args.resume)
    if args.save_ckpt:
        trainer.save_checkpoint(os.path.join(args.out, "last.ckpt"))
    strategy = trainer.strategy
    record = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "seed": strategy.seed,
        "rank_seed": strategy.rank_seed,
        "rank_seeds": strategy.rank_seeds,
        "sampler_seed": strategy.sampler_seed,
        "seen": {str(epoch): indices for epoch, indices in model.seen.items()},
        "first_noise": model.first_noise,
        "global_step": trainer.global_step,
        "trace": model.trace,
        "incidents": [
            {k: v for k, v in i.to_dict().items() if k in ("step", "reason", "outcome")} for i in rollback.incidents
        ],
        "injections": [list(i) for i in fault.injections] if fault is not None else [],
        "fingerprint": strategy.fingerprint(),
    }
    with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(record, handle, indent=1)
    torch.save(
        {k: v.cpu() for k, v in model.state_dict().items()},
        os.path.join(args.out, f"weights_rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1:])
