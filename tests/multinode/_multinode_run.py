"""Test helper: one simulated node of a multi-node ``fit`` (gloo over loopback), in a fresh process.

Usage (from the tests; one launch per simulated node, all with the same ``--port``)::

    python _multinode_run.py --out DIR --num-nodes 2 --node-rank 1 --devices 2 --port P [--launcher torchrun]

``--launcher lightning`` (default) sets ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` and lets
Lightning's ``LightningEnvironment`` start the node's other processes; ``--launcher torchrun``
re-executes this script under ``torch.distributed.run`` (``--nnodes``, ``--node-rank``, static
rendezvous), whose ``RANK``/``LOCAL_RANK``/``GROUP_RANK``/``TORCHELASTIC_RUN_ID`` variables make
Lightning pick ``TorchElasticEnvironment``.

The run: a tiny MLP with dropout, a shuffled loader with one worker whose ``__getitem__`` augments
with torch and numpy noise, ``DeterminismCallback`` (seekable loader: exact mid-epoch resume), the
health callbacks with snapshots on disk under ``DIR/snapshots``, and ``strategy="ddp_deterministic"``.
Every rank appends one JSON line per step of the loop to ``DIR/trace.rank{g}.jsonl`` (step, its
input sum, a draw of its random stream, its parameter sum, its own loss and the logged, rank-averaged
``train/loss``, all as ``float.hex``), and at the end writes
``DIR/rank{g}.json`` (layout, seeds, samples seen, health events, fingerprints, snapshot files) and
``DIR/weights_rank{g}.pt``. ``--module deepep`` trains a small DeepEP agent instead (CartPole rollouts,
no loader data: its trace rows are ``[step, loss, logged loss, parameter sum]``); ``--module tiny,deepep``
fits both in turn in the same processes and process group, the second writing to ``DIR/deepep``. ``--kill-at S``
SIGKILLs every process at the start of step ``S``; checkpoints go to ``--ckpt-dir`` every
``--ckpt-every`` steps (atomically).

``--then --out DIR2 [ARGS...]`` (repeatable) fits again in the same processes and process group once the
fits before it are done, with the node layout (``--num-nodes``, ``--node-rank``, ``--devices``, ``--port``)
of the first arguments and its own other arguments; the Lightning launcher only::

    python _multinode_run.py --out A --num-nodes 2 --node-rank 0 --devices 2 --port P --then --out B --max-steps 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from tests._chained_fits import chained_fits  # noqa: E402

torch.set_num_threads(1)

SEED = 4321
NUM_SAMPLES = 64
BATCH_SIZE = 4


class _AugmentedDataset(torch.utils.data.Dataset):
    """Fixed points; ``__getitem__`` adds torch and numpy noise (worker-side randomness)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(NUM_SAMPLES, 6, generator=generator)
        self.y = self.x[:, :2].sum(1, keepdim=True).tanh()

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int):
        import numpy as np

        noise = torch.randn(6) * 0.1 + torch.from_numpy(np.random.uniform(-0.05, 0.05, 6)).float()
        return self.x[index] + noise, self.y[index], index


def _module(trace_path: str):
    import lightning.pytorch as pl

    class TinyModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
            )
            self.seen: dict[int, list[int]] = {}
            self.first_dropout_draw: float | None = None

        def on_train_batch_start(self, batch, batch_idx):
            self.seen.setdefault(self.current_epoch, []).extend(int(i) for i in batch[2])

        def training_step(self, batch, batch_idx):
            x, y, _ = batch
            with torch.random.fork_rng():  # the step's stream, read without consuming it
                draw = float(torch.rand(()))
            if self.first_dropout_draw is None:
                self.first_dropout_draw = draw
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train/loss", loss, sync_dist=True)  # averaged over the ranks: one value on all
            params = float(sum(p.detach().double().sum() for p in self.parameters()))  # the weights the step sees
            self._pending = [int(self.global_step), float(x.sum()).hex(), draw.hex(), params.hex()]
            self._pending.append(float(loss.detach()).hex())
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            logged = self.trainer.callback_metrics.get("train/loss")
            row = [*self._pending, float(logged).hex() if logged is not None else None]
            with open(trace_path, "a") as handle:
                handle.write(json.dumps(row) + "\n")

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_AugmentedDataset(), batch_size=BATCH_SIZE, shuffle=True, num_workers=1)

    return TinyModule()


def _deepep_module(trace_path: str):
    """A small DeepEP agent (rollouts keyed by the global rank), tracing ``[step, loss, logged, parameter sum]``."""
    from deepep_lightning.deepep import DeepEPModule
    from deepep_lightning.deepep.config import grouped

    class TracedDeepEP(DeepEPModule):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            logged = self.trainer.callback_metrics["train/loss"]
            params = float(sum(p.detach().double().sum() for p in self.parameters()))
            row = [int(self.global_step) - 1, float(outputs["loss"]).hex(), float(logged).hex(), params.hex()]
            with open(trace_path, "a") as handle:
                handle.write(json.dumps(row) + "\n")

    sizes = {"num_envs": 4, "rollout_length": 6, "hidden_size": 8, "steps_per_epoch": 4}
    return TracedDeepEP(**grouped(name="cartpole", seed=SEED, fused_value_head=False, **sizes))


def _strategy(args):
    from deepep_lightning.strategies import DeterministicDDPStrategy

    class LocalRankSeeded(DeterministicDDPStrategy):
        """A planted bug (negative control): the per-step streams keyed by the node-local rank."""

        def virtual_rank(self, batch_idx: int) -> int:
            return self.local_rank

    cls = LocalRankSeeded if args.seed_by_local_rank else DeterministicDDPStrategy
    # a collective of these small steps takes milliseconds: a rank that waits 5 minutes waits for a hung peer,
    # and fails the test then instead of after gloo's default 30 minutes
    return cls(timeout=datetime.timedelta(seconds=300), **json.loads(args.strategy_kwargs))


def _torchrun(args, argv: list[str]) -> None:
    """Replace this process by ``torchrun`` running this script for one node (same pid: same process group)."""
    rest = [a for a in argv if a not in ("--launcher", "torchrun")]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={args.num_nodes}",
        f"--nproc-per-node={args.devices}",
        f"--node-rank={args.node_rank}",
        "--master-addr=127.0.0.1",
        f"--master-port={args.port}",
        "--rdzv-backend=static",
        "--max-restarts=0",
        "--monitor-interval=0.5",
        os.path.abspath(__file__),
        *rest,
        "--launcher",
        "torchrun-worker",
    ]
    os.execv(sys.executable, command)


_LAYOUT = ("--num-nodes", "--node-rank", "--devices", "--port")


def main(argv: list[str]) -> None:
    segments = chained_fits(argv)
    first = _parse(segments[0])
    if len(segments) > 1 and first.launcher != "lightning":
        raise SystemExit("--then: with the Lightning launcher only")
    layout = [str(x) for x in (first.num_nodes, first.node_rank, first.devices, first.port)]
    fits = [(first, segments[0])] + [
        (_parse([*(token for pair in zip(_LAYOUT, layout) for token in pair), *segment]), segment)
        for segment in segments[1:]
    ]
    for args, segment in fits:
        _run(args, segment)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="this node's directory (node-local) or the shared one")
    parser.add_argument("--ckpt-dir", default=None, help="where checkpoints are written (default: --out)")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--launcher", choices=["lightning", "torchrun", "torchrun-worker"], default="lightning")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--ckpt-every", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--fault-rank", type=int, default=-1, help="global rank whose loss turns infinite")
    parser.add_argument("--fault-step", type=int, default=5)
    parser.add_argument("--corrupt-rank", type=int, default=-1, help="global rank whose newest snapshot is cut")
    parser.add_argument("--seed-by-local-rank", action="store_true", help="negative control: a planted bug")
    parser.add_argument(
        "--module", default="tiny", help="tiny, deepep, or both in turn (tiny,deepep: the second in DIR/deepep)"
    )
    parser.add_argument("--strategy-kwargs", default="{}", help="JSON arguments of DeterministicDDPStrategy")
    args = parser.parse_args(argv)
    if not set(args.module.split(",")) <= {"tiny", "deepep"}:
        parser.error(f"--module: tiny, deepep or a comma-separated list of them, got {args.module!r}")
    return args


def _run(args: argparse.Namespace, argv: list[str]) -> None:
    """The fits of one ``--module`` list with ``args`` (``argv``: their tokens, re-executed by torchrun)."""
    if args.launcher == "torchrun":
        _torchrun(args, argv)
    if args.launcher == "lightning":
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.port), "NODE_RANK": str(args.node_rank)})
    modules = args.module.split(",")
    for i, module in enumerate(modules):
        _fit(args, module, args.out if i == 0 else os.path.join(args.out, module))
        # the node's first process has started the others: the next fit runs in the same process group
        os.environ.setdefault("LOCAL_RANK", "0")


def _fit(args, module: str, out: str) -> None:
    """One fit of ``module`` writing its traces, records and weights to ``out``."""
    import lightning.pytorch as pl

    from deepep_lightning.determinism import DeterminismCallback, configure
    from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback

    configure(SEED)  # before the model: its initial weights are seeded

    class RankFault(FaultInjectionCallback):
        """An infinite loss *value* on one global rank (its gradient stays finite: no all-reduce carries it)."""

        def setup(self, trainer, pl_module, stage):
            self._rank = trainer.global_rank
            super().setup(trainer, pl_module, stage)

        def _poison_loss(self, step, output):
            if self._rank == args.fault_rank and self._fire(step):
                return output + output.detach() * float("inf")
            return output

    class CutNewestSnapshot(pl.Callback):
        """On one global rank, truncate the newest snapshot file when the faulty step starts."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_rank == args.corrupt_rank and trainer.global_step == args.fault_step:
                path = rollback.ring.files()[-1]
                with open(path, "r+b") as handle:
                    handle.truncate(100)

    class CheckpointThenKill(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if args.ckpt_every and trainer.global_step % args.ckpt_every == 0:
                path = os.path.join(args.ckpt_dir or out, "last.ckpt")
                trainer.save_checkpoint(path + ".tmp")  # every rank: the per-rank state is gathered
                if trainer.is_global_zero:
                    os.replace(path + ".tmp", path)
                trainer.strategy.barrier("checkpoint renamed")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if args.kill_at is not None and trainer.global_step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # every rank reaches this step: the whole job dies

    class ReadsLossEveryStep(pl.Callback):  # the traces read train/loss after every step; DeepEP logs it then
        def monitored_metrics(self) -> tuple[str, ...]:
            return ("train/loss",)

    health = NumericalHealthCallback(check_every_n_steps=1, spike_detection=False, log_norms=False)
    rollback = NaNRollbackCallback(snapshot_every_n_steps=2, keep_snapshots=3, snapshot_dir="snapshots", locate=False)
    callbacks = [DeterminismCallback(SEED, log_fingerprint=False), health, rollback, CheckpointThenKill()]
    callbacks.append(ReadsLossEveryStep())
    if args.fault_rank >= 0:
        callbacks.insert(0, RankFault("loss", steps=[args.fault_step], mode="once"))
    if args.corrupt_rank >= 0:
        callbacks.insert(0, CutNewestSnapshot())
    os.makedirs(out, exist_ok=True)
    global_rank = int(os.environ.get("RANK", args.node_rank * args.devices + int(os.environ.get("LOCAL_RANK", "0"))))
    trace_path = os.path.join(out, f"trace.rank{global_rank}.jsonl")
    model = _module(trace_path) if module == "tiny" else _deepep_module(trace_path)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=_strategy(args),
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=False,
        default_root_dir=out,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, ckpt_path=args.resume)
    strategy = trainer.strategy
    assert trainer.global_rank == global_rank, (trainer.global_rank, global_rank)
    record = {
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "cluster_environment": type(strategy.cluster_environment).__name__,
        "rank_seed": strategy.rank_seed,
        "sampler_seed": strategy.sampler_seed,
        "seen": {str(epoch): indices for epoch, indices in getattr(model, "seen", {}).items()},
        "first_dropout_draw": getattr(model, "first_dropout_draw", None),
        "global_step": trainer.global_step,
        "events": [[e["kind"], e["step"]] for e in health.events.events],
        "events_file": health.events.path,
        "snapshot_dir": rollback.ring.directory if rollback.ring is not None else None,
        "snapshot_files": sorted(os.listdir(rollback.ring.directory)) if rollback.ring is not None else [],
        "fingerprint": strategy.fingerprint(),
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as handle:
        json.dump(record, handle, indent=1)
    weights = {k: v.cpu() for k, v in model.state_dict().items()}
    torch.save(weights, os.path.join(out, f"weights_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1:])
