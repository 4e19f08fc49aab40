"""Two-process gloo fits for the rollback's DDP tests, run in fresh processes (``fit_process``).

Usage: ``python tests/health/_ddp_scenarios.py OUT_DIR SCENARIO [SCENARIO ...]``. The command is rank 0:
it starts rank 1 as a copy of itself (``LOCAL_RANK=1``, in its session), and both run the scenarios'
fits in turn under ``strategy="ddp"`` in one gloo process group (Lightning launches no process when
``LOCAL_RANK`` is set), so the job pays for two interpreter start-ups, not two per fit. Each rank writes
``OUT_DIR/<run>.rank<r>.json`` with its final weights, its health events and its step.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback  # noqa: E402
from tests.health.conftest import ToyModule, make_trainer  # noqa: E402


class RankFault(FaultInjectionCallback):
    """An infinite loss value on one rank only (gradients stay finite: nothing carries it to the other rank)."""

    def __init__(self, rank: int, *args, **kwargs) -> None:
        super().__init__("loss", *args, **kwargs)
        self.rank = rank

    def setup(self, trainer, pl_module, stage):
        self._rank = trainer.global_rank
        super().setup(trainer, pl_module, stage)

    def _poison_loss(self, step, output):
        if self._rank == self.rank and self._fire(step):
            return output + output.detach() * float("inf")
        return output


class TruncateNewestSnapshot(pl.Callback):
    """On rank 1 only, truncate the newest snapshot file when step ``step`` starts."""

    def __init__(self, rollback: NaNRollbackCallback, step: int) -> None:
        self.rollback, self.step = rollback, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and trainer.global_step == self.step:
            path = Path(self.rollback.ring.files()[-1])
            path.write_bytes(path.read_bytes()[:100])


class Report(pl.Callback):
    def __init__(self, path: str, health: NumericalHealthCallback, rollback: NaNRollbackCallback) -> None:
        self.path, self.health, self.rollback = path, health, rollback

    def on_train_end(self, trainer, pl_module):
        state = {k: v.tolist() for k, v in pl_module.state_dict().items()}
        events = [(e["kind"], e["step"]) for e in self.health.events.events]
        rollback = self.rollback.state_dict()
        with open(f"{self.path}.rank{trainer.global_rank}.json", "w") as handle:
            json.dump({"state": state, "events": events, "step": trainer.global_step, "rollback": rollback}, handle)


def fit(
    out: Path, name: str, faults: list, max_steps: int = 10, module=ToyModule, health_args=None, **rollback_args
) -> None:
    health = NumericalHealthCallback(**{"check_every_n_steps": 2, **(health_args or {})})
    rollback = NaNRollbackCallback(**{"snapshot_every_n_steps": 4, **rollback_args})
    extra = [make(rollback) if callable(make) and not isinstance(make, pl.Callback) else make for make in faults]
    callbacks = [*extra, health, rollback, Report(str(out / name), health, rollback)]
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(out / name, callbacks, max_steps=max_steps, strategy="ddp", devices=2)
    trainer.fit(module())


def _start_rank_one() -> subprocess.Popen | None:
    """As rank 0 (no ``LOCAL_RANK`` yet): start rank 1 running this command; ``None`` in rank 1."""
    if "LOCAL_RANK" in os.environ:
        return None
    port = os.environ.get("MASTER_PORT")  # the tests' launcher gives each child its own (conftest.free_port)
    if port is None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = str(probe.getsockname()[1])
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": "0"})
    peer = subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, "LOCAL_RANK": "1"})
    os.environ["LOCAL_RANK"] = "0"
    return peer


def run_scenario(out: Path, scenario: str) -> None:
    if scenario == "skip":
        # a reproducible failure on rank 1 only: both ranks skip the step together
        fit(out, "skip", [RankFault(1, steps=[5], mode="always")], policy="skip", locate=False)
    elif scenario == "corrupt":
        # rank 1's newest snapshot (step 8) is truncated before a transient fault at step 9
        fit(out, "clean", [])
        fit(
            out,
            "corrupt",
            [RankFault(0, steps=[9]), lambda rollback: TruncateNewestSnapshot(rollback, step=9)],
            keep_snapshots=3,
            snapshot_dir="snaps",
        )
    elif scenario == "fault":
        # an infinite loss on rank 1 only at step 5, compared with "clean"
        fit(out, "faulty", [RankFault(1, steps=[5])])
    elif scenario == "regression":
        # the metric collapses on rank 1 only (its weights are blown up): the averaged metric decides for both
        from deepep_lightning.health import RegressionTrigger
        from tests.health.test_regression import Collapse, ScoredModule

        fit(
            out,
            "regression",
            [Collapse(20, rank=1)],
            max_steps=30,
            module=ScoredModule,
            health_args={"spike_detection": False},
            policy="lower_lr",
            regression=RegressionTrigger("train/score", mode="max", threshold=1.0, patience=2),
        )
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


def main() -> None:
    out, scenarios = Path(sys.argv[1]), sys.argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    peer = _start_rank_one()
    for scenario in scenarios:
        run_scenario(out, scenario)
    if peer is not None:
        sys.exit(peer.wait())


if __name__ == "__main__":
    main()
