"""DeterministicDDPStrategy with 2 gloo processes, launched through ``strategy="ddp_deterministic"``.

Each run is ``_ddp_run.py`` in a fresh session (``fit_process``; Lightning's launcher starts rank 1);
a progress-based deadline kills the whole session, so a hung rank fails the test instead of hanging CI. Four runs in
all: two clean ones (A, B), one with a fault on rank 1 only (C) and one single-process run in
world-size-invariant mode (V). C fits after B in B's processes (``--then``): B is the first fit there, as
A is in its own, and C must still end with A's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepep_lightning.determinism.streams import derive_seed
from deepep_lightning.strategies import CHECKPOINT_KEY, DeterministicDDPStrategy

SCRIPT = Path(__file__).with_name("_ddp_run.py")
SEED, NUM_SAMPLES = 321, 32  # as in _ddp_run.py
FAULT_STEP = 5  # 4 steps per epoch: the rollback restores the epoch-end snapshot and replays across the boundary


def _start(fit_process, out: Path, *args: str, then: tuple[tuple[Path, list[str]], ...] = ()):
    """``_ddp_run.py`` into ``out``, then the fits ``then`` (directory, arguments) in turn in its processes."""
    command = ["--out", str(out), *args]
    for fit_out, fit_args in then:
        fit_out.mkdir(parents=True, exist_ok=True)
        command += ["--then", "--out", str(fit_out), *fit_args]
    out.mkdir(parents=True, exist_ok=True)
    return fit_process(SCRIPT, command, log_path=out / "log.txt", cwd=out)


def _rank(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def _weights(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"weights_rank{rank}.pt", weights_only=True)


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fit_process) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ddp")
    arguments = {
        "A": ["--save-ckpt"],
        "B": [],
        "C": ["--fault-rank", "1", "--fault-step", str(FAULT_STEP)],
        # one process, two micro-batches per step (the health callbacks need accumulate_grad_batches=1)
        "V": ["--devices", "1", "--no-health", "--accumulate", "2"]
        + ["--strategy-kwargs", json.dumps({"virtual_world_size": 2})],
    }
    chained = {"B": "C"}  # C after B, in B's processes
    started = {  # all at once
        name: _start(
            fit_process, root / name, *args, then=tuple((root / c, arguments[c]) for c in chained.get(name, ""))
        )
        for name, args in arguments.items()
        if name not in chained.values()
    }
    for name, code in fit_process.wait_all(started).items():
        assert code == 0, f"{name}: exit code {code}\n{started[name].output_tail()}"
    return {name: root / name for name in arguments}


def test_comparison_detects_one_ulp():
    # negative control for the bitwise assertions below
    a = {"w": torch.ones(3)}
    b = {"w": torch.ones(3)}
    b["w"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert not _bitwise_equal(a, b)


@pytest.mark.slow
def test_two_runs_are_bitwise_equal(runs):
    a0, a1, b0 = _weights(runs["A"], 0), _weights(runs["A"], 1), _weights(runs["B"], 0)
    assert _bitwise_equal(a0, b0)
    assert _bitwise_equal(a0, a1)  # DDP keeps the ranks equal
    assert _rank(runs["A"], 0)["trace"] == _rank(runs["B"], 0)["trace"]  # losses step by step
    assert _rank(runs["A"], 0)["global_step"] == 8


@pytest.mark.slow
def test_shards_are_disjoint_covering_and_a_pure_function(runs):
    seen = [_rank(runs["A"], rank)["seen"] for rank in (0, 1)]
    for epoch in ("0", "1"):
        assert sorted(seen[0][epoch] + seen[1][epoch]) == list(range(NUM_SAMPLES))
        for rank in (0, 1):
            assert seen[rank][epoch] == DeterministicDDPStrategy.shard(NUM_SAMPLES, SEED, int(epoch), rank, 2)
    assert seen[0]["0"] != seen[0]["1"]  # set_epoch: a new order every epoch
    assert seen == [_rank(runs["B"], rank)["seen"] for rank in (0, 1)]


@pytest.mark.slow
def test_every_rank_destroys_its_gloo_group_before_the_interpreter_finalizes(runs):
    # the negative control (a gloo group with no handler is still alive at exit) is in test_process_group_exit.py
    for rank in (0, 1):
        assert json.loads((runs["A"] / f"exit_rank{rank}.json").read_text()) == {"process_group_initialized": False}


@pytest.mark.slow
def test_per_rank_seeds_are_derived_different_and_recorded(runs):
    records = [_rank(runs["A"], rank) for rank in (0, 1)]
    expected = [derive_seed(SEED, "rank", rank) for rank in (0, 1)]
    assert [r["rank_seed"] for r in records] == expected
    assert expected[0] != expected[1]
    assert records[0]["first_noise"] != records[1]["first_noise"]  # augmentation differs between ranks
    assert json.loads(records[0]["fingerprint"]["ddp.rank_seeds"]) == expected
    checkpoint = torch.load(runs["A"] / "last.ckpt", weights_only=False)
    state = checkpoint[CHECKPOINT_KEY]
    assert state["world_size"] == 2 and state["rank_seeds"] == expected and state["seed"] == SEED
    assert len(state["per_rank"]) == 2 and "callbacks" in state["per_rank"][1]


@pytest.mark.slow
def test_fault_on_rank_one_rolls_back_every_rank_in_lockstep(runs):
    records = [_rank(runs["C"], rank) for rank in (0, 1)]
    assert records[0]["injections"] == [] and records[1]["injections"] == [[FAULT_STEP, "gradient"]]
    assert records[1]["incidents"] == [{"step": FAULT_STEP, "reason": "nonfinite_grad", "outcome": "transient"}]
    assert records[0]["incidents"] == [{"step": FAULT_STEP, "reason": "other_rank", "outcome": "transient"}]
    for record in records:  # both ranks replayed the bad step once
        assert [row[0] for row in record["trace"]].count(FAULT_STEP) == 2
    c0, c1 = _weights(runs["C"], 0), _weights(runs["C"], 1)
    assert _bitwise_equal(c0, c1)
    assert all(torch.isfinite(t).all() for t in c0.values())
    assert _bitwise_equal(c0, _weights(runs["A"], 0))  # as if the fault had never happened


@pytest.mark.slow
def test_resume_with_a_different_world_size_is_refused(runs):
    # what Trainer.fit(ckpt_path=...) calls first on every rank; in this process (no second
    # subprocess run: CI time) with the checkpoint the 2-process run wrote
    from lightning.pytorch import Trainer

    from deepep_lightning.strategies import WorldSizeMismatchError

    def strategy(devices: int) -> DeterministicDDPStrategy:
        trainer = Trainer(
            accelerator="cpu",
            devices=devices,
            strategy="ddp_deterministic",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        return trainer.strategy

    checkpoint = strategy(2).load_checkpoint(runs["A"] / "last.ckpt")  # negative control: same size resumes
    assert checkpoint["global_step"] == 8 and checkpoint[CHECKPOINT_KEY]["world_size"] == 2
    with pytest.raises(WorldSizeMismatchError, match=r"world_size=2, this run has world_size=1.*HINT"):
        strategy(1).load_checkpoint(runs["A"] / "last.ckpt")


@pytest.mark.slow
def test_one_process_equals_two_in_world_size_invariant_mode(runs):
    # virtual_world_size=2: one process accumulates the micro-batches the two ranks of run A computed
    one, two = _rank(runs["V"], 0), [_rank(runs["A"], rank) for rank in (0, 1)]
    assert one["world_size"] == 1 and one["global_step"] == two[0]["global_step"] == 8
    micro = [row[3] for row in one["trace"]]
    assert micro[0::2] == [row[3] for row in two[0]["trace"]]  # micro-batch 0 of each step = rank 0's batch
    assert micro[1::2] == [row[3] for row in two[1]["trace"]]
    assert _bitwise_equal(_weights(runs["V"], 0), _weights(runs["A"], 0))
