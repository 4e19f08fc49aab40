"""Test helper: one ``fit`` with Lightning's ``ModelParallelStrategy`` and ``fully_shard`` (FSDP2) on CPU (gloo).

Usage (from the tests)::

    python _fsdp2_run.py --out DIR [--devices 2] [--tensor-parallel 1] [--health] [--fault-rank R --fault-step S]
                         [--ckpt-every N] [--kill-at N] [--resume DIR] [--no-reseed]
                         [--snapshot-dir DIR --truncate-snapshot-rank R]

Lightning's subprocess launcher re-runs this script for ranks >= 1. The module is a 2-layer MLP whose
layers and root are sharded with ``fully_shard`` over the data-parallel mesh (with ``--tensor-parallel 2``,
the first layer is column-parallel and the second row-parallel over the tensor-parallel mesh first).
Every rank writes ``DIR/rank{r}.json`` (losses step by step, rollback incidents, health events) and
``DIR/weights_rank{r}.pt`` (the **full** ``state_dict``, gathered from the shards). ``--ckpt-every N``
writes a sharded Lightning checkpoint (a directory) to ``DIR/ckpt-step{N}`` every ``N`` optimizer
steps; ``--kill-at N`` SIGKILLs every rank at the start of the batch after global step ``N``
(mid-epoch); ``--resume DIR`` resumes from such a directory.
``--truncate-snapshot-rank R`` truncates rank ``R``'s newest snapshot file when ``--fault-step`` starts;
``--nan-op-rank R`` makes ``aten.log`` inside ``net.0``'s forward produce NaN on rank ``R`` at every run of
step ``--fault-step`` (a reproducible failure: the rollback's locator names it).

``--then --out DIR2 [ARGS...]`` (repeatable, the same ``--devices``) fits again with those arguments in the
same processes and process group once the fits before it are done; each fit starts from ``configure``,
``seed_everything`` and a new Trainer and module.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from tests._chained_fits import fit_in_one_process_group  # noqa: E402

torch.set_num_threads(1)

SEED = 4321
NUM_SAMPLES = 48
BATCH_SIZE = 4


class _Dataset(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(NUM_SAMPLES, 8, generator=generator)
        self.y = self.x[:, :2].sum(1, keepdim=True).tanh()

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]


class _Linear(torch.nn.Linear):
    """A linear layer whose output goes NaN through ``aten.log`` while ``nan_in_forward`` is set."""

    nan_in_forward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.nan_in_forward:
            out = out + torch.full_like(out, -1.0).log()
        return out


def _module(tensor_parallel: int, seed_per_rank: bool, nan_op_rank: int, nan_op_step: int):
    import lightning.pytorch as pl
    from torch.distributed.fsdp import fully_shard

    class ShardedMLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(_Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.trace: list = []  # (step, loss) of every training_step call, replays included

        def configure_model(self) -> None:
            mesh = self.device_mesh
            if tensor_parallel > 1:
                from torch.distributed.tensor.parallel import (
                    ColwiseParallel,
                    RowwiseParallel,
                    parallelize_module,
                )

                plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
                parallelize_module(self.net, mesh["tensor_parallel"], plan)
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh["data_parallel"])
            fully_shard(self, mesh=mesh["data_parallel"])

        def on_train_start(self) -> None:
            if seed_per_rank:  # a stream of its own per data-parallel rank (a resume puts the saved one back later)
                torch.manual_seed(SEED + self.device_mesh["data_parallel"].get_local_rank())

        def training_step(self, batch, batch_idx):
            x, y = batch
            # a reproducible NaN inside net.0's forward on one rank (replays and the locator's run included)
            self.net[0].nan_in_forward = self.global_rank == nan_op_rank and self.global_step == nan_op_step
            noise = torch.randn_like(x) * 0.1  # augmentation from the global RNG
            loss = torch.nn.functional.mse_loss(self.net(x + noise), y)
            self.trace.append([int(self.global_step), float(loss.detach())])
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_Dataset(), batch_size=BATCH_SIZE, shuffle=True)

    return ShardedMLP()


def _full_weights(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    full = {}
    for name, value in model.state_dict().items():
        full[name] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()
    return full


def main(argv: list[str]) -> None:
    fit_in_one_process_group(argv, lambda arguments, index: _fit(arguments))


def _fit(argv: list[str]) -> None:
    """One fit with the arguments ``argv``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--health", action="store_true", help="add NumericalHealthCallback and NaNRollbackCallback")
    parser.add_argument("--snapshot-dir", default=None)
    parser.add_argument("--fault-rank", type=int, default=-1)
    parser.add_argument("--fault-step", type=int, default=5)
    parser.add_argument("--fault-target", default="gradient", help="FaultInjectionCallback target")
    parser.add_argument("--fault-mode", default="once", help="once: transient; always: reproducible")
    parser.add_argument("--policy", default="skip", help="NaNRollbackCallback policy")
    parser.add_argument("--nan-op-rank", type=int, default=-1, help="aten.log makes NaN in net.0 at --fault-step")
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--model-checkpoint", action="store_true", help="Lightning's ModelCheckpoint every 3 steps")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument(
        "--no-reseed", action="store_true", help="DeterminismCallback(reseed_every_step=False), a seed per rank"
    )
    parser.add_argument("--truncate-snapshot-rank", type=int, default=-1, help="at --fault-step, on that rank")
    args = parser.parse_args(argv)

    from deepep_lightning import configure

    configure(SEED)  # first: before CUDA starts (the process group of a CUDA run takes the device)

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    from deepep_lightning import DeterminismCallback, NaNRollbackCallback, NumericalHealthCallback
    from deepep_lightning.health import FaultInjectionCallback

    pl.seed_everything(SEED, verbose=False)
    rank = int(os.environ.get("LOCAL_RANK", "0"))

    class CheckpointThenKill(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if args.ckpt_every and trainer.global_step % args.ckpt_every == 0:
                trainer.save_checkpoint(os.path.join(args.out, f"ckpt-step{trainer.global_step}"))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if args.kill_at is not None and trainer.global_step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    class TruncateNewestSnapshot(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_rank == args.truncate_snapshot_rank and trainer.global_step == args.fault_step:
                path = rollback.ring.files()[-1]
                with open(path, "r+b") as handle:
                    handle.truncate(100)

    determinism = DeterminismCallback(SEED, log_fingerprint=False, reseed_every_step=not args.no_reseed)
    callbacks: list = [determinism, CheckpointThenKill(), TruncateNewestSnapshot()]
    rollback = health = None
    if args.health:
        rollback = NaNRollbackCallback(
            snapshot_every_n_steps=4, keep_snapshots=2, snapshot_dir=args.snapshot_dir, policy=args.policy
        )
        health = NumericalHealthCallback(check_every_n_steps=1, spike_detection=False, log_norms=False)
        callbacks += [health, rollback]
    fault = None
    if rank == args.fault_rank:
        fault = FaultInjectionCallback(args.fault_target, steps=[args.fault_step], mode=args.fault_mode)
        callbacks.append(fault)
    if args.model_checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(args.out, "mc"), every_n_train_steps=3, save_last=True))
    model = _module(args.tensor_parallel, args.no_reseed, args.nan_op_rank, args.fault_step)
    strategy = ModelParallelStrategy(
        data_parallel_size=args.devices // args.tensor_parallel, tensor_parallel_size=args.tensor_parallel
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        strategy=strategy,
        max_epochs=args.max_epochs,
        callbacks=callbacks,
        logger=False,
        default_root_dir=args.out,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=args.model_checkpoint,
    )
    trainer.fit(model, ckpt_path=args.resume)
    record = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "trace": model.trace,
        "incidents": [
            {k: v for k, v in i.to_dict().items() if k in ("step", "reason", "outcome")} for i in rollback.incidents
        ]
        if rollback is not None
        else [],
        "diagnoses": [
            {
                "classification": i.classification,
                "op": (i.diagnosis or {}).get("op"),
                "module_path": (i.diagnosis or {}).get("module_path"),
            }
            for i in rollback.incidents
            if i.diagnosed
        ]
        if rollback is not None
        else [],
        "injections": [list(i) for i in fault.injections] if fault is not None else [],
        "events": [[e["kind"], e["step"]] for e in health.events.events] if health is not None else [],
    }
    weights = _full_weights(model)  # collective: every rank gathers
    with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(record, handle, indent=1)
    torch.save(weights, os.path.join(args.out, f"weights_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1:])
