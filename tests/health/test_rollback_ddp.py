"""Rollback under DDP (2 CPU processes, gloo): a fault on one rank, one agreed decision, bitwise recovery."""

import json
import os

import lightning.pytorch as pl
import pytest
import torch

from deepep_lightning.health import FaultInjectionCallback, NaNRollbackCallback, NumericalHealthCallback

from .conftest import ToyModule, make_trainer


class RankOneFault(FaultInjectionCallback):
    """An infinite loss *value* on rank 1 only; gradients stay finite, so no all-reduce carries it to rank 0.

    Rank 0 sees nothing wrong: only the agreed verdict makes it roll back too. Without agreement,
    rank 1 would replay alone and its extra all-reduces would hang the job.
    """

    def setup(self, trainer, pl_module, stage):
        self._rank = trainer.global_rank
        super().setup(trainer, pl_module, stage)

    def _poison_loss(self, step, output):
        if self._rank == 1 and self._fire(step):
            return output + output.detach() * float("inf")
        return output


class Report(pl.Callback):
    def __init__(self, path, health):
        self.path, self.health = path, health

    def on_train_end(self, trainer, pl_module):
        state = {k: v.tolist() for k, v in pl_module.state_dict().items()}
        events = [(e["kind"], e["step"]) for e in self.health.events.events]
        with open(f"{self.path}.rank{trainer.global_rank}.json", "w") as handle:
            json.dump({"state": state, "events": events, "step": trainer.global_step}, handle)


def _run(tmp_path, name, fault):
    health = NumericalHealthCallback(check_every_n_steps=2)
    callbacks = ([RankOneFault("loss", steps=[5])] if fault else []) + [
        health,
        NaNRollbackCallback(snapshot_every_n_steps=4),
        Report(str(tmp_path / name), health),
    ]
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, callbacks, max_steps=10, strategy="ddp_spawn", devices=2)
    trainer.fit(ToyModule())
    return [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_fault_on_one_rank_agreed_and_recovered_bitwise(tmp_path):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    clean = _run(tmp_path, "clean", fault=False)
    faulty = _run(tmp_path, "faulty", fault=True)
    for rank in (0, 1):
        # both ranks take the same decision although only rank 1 saw a non-finite loss
        assert [tuple(e) for e in faulty[rank]["events"]] == [("detected", 5), ("rollback", 4), ("transient", 5)]
        assert clean[rank]["events"] == []
        assert faulty[rank]["state"] == clean[rank]["state"] and faulty[rank]["step"] == 10
    assert faulty[0]["state"] == faulty[1]["state"]  # the ranks stayed in sync
