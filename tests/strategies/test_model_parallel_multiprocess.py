"""FSDP2 (``fully_shard`` under Lightning's ``ModelParallelStrategy``) with 2 and 4 gloo processes.

Each launch is ``_fsdp2_run.py`` in a fresh session (``fit_process``; Lightning's launcher starts the other
ranks), with DeterminismCallback, NumericalHealthCallback and NaNRollbackCallback; runs named together in a
chain fit in turn in the same processes and process group (``--then``), each from ``configure``,
``seed_everything`` and a new Trainer. Two processes:
a clean run that writes sharded checkpoints (A), the same run SIGKILLed mid-epoch (K), K resumed
from its step-8 directory (R), the same resume without the loader position (N, negative control),
a NaN on rank 1's gradient shard while rank 0's newest snapshot file is truncated (C), a reproducible
NaN inside ``net.0`` on rank 1 (L, located and skipped on both ranks) and a one-process resume of A's
checkpoint (W, refused); chains A, C, L, K (killed last) and N, R (N first in its processes, as a
fresh run; R after it, equal to A). Four processes: a run whose RNG is not reseeded
per batch (A4) and its resume (R4), so only the per-rank RNG states carry the random stream, and a
data + tensor parallel run (2 x 2, T4), fitted after A4 in its processes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

SCRIPT = Path(__file__).with_name("_fsdp2_run.py")
STEPS = 12  # 48 samples, batch 4, 2 data-parallel ranks, 2 epochs
FAULT_STEP = 5

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed"),
]


def _run_together(
    fit_process, root: Path, runs: dict[str, list[str] | dict[str, list[str]]], may_fail: tuple[str, ...] = ()
) -> dict[str, Path]:
    """Start every launch at once; wait for all of them; the directory ``root / name`` of every run.

    A launch is one run (name: arguments) or a chain (launch name: {run name: arguments}) whose runs fit
    in turn in the same processes, each into its own directory; a launch's output goes to the ``log.txt``
    of its first run. Each launch must exit with 0 unless it is named in ``may_fail``."""
    processes, made = {}, {}
    for launch, spec in runs.items():
        chain = spec if isinstance(spec, dict) else {launch: spec}
        args: list[str] = []
        for name, run_args in chain.items():
            made[name] = root / name
            made[name].mkdir(parents=True, exist_ok=True)
            args += [*(["--then"] if args else []), "--out", str(made[name]), *run_args]
        first = made[next(iter(chain))]
        processes[launch] = fit_process(SCRIPT, args, log_path=first / "log.txt", cwd=first)
    codes = fit_process.wait_all(processes)
    for launch, code in codes.items():
        assert code == 0 or launch in may_fail, f"{launch}: exit code {code}\n{processes[launch].output_tail()}"
    return made


def _rank(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def _weights(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"weights_rank{rank}.pt", weights_only=True)


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _determinism_state(checkpoint: dict) -> dict:
    return next(v for k, v in checkpoint["callbacks"].items() if k.startswith("DeterminismCallback"))


def _without_loader_position(directory: Path, copy: Path) -> Path:
    """A copy of a sharded checkpoint whose DeterminismCallback state lost the loader position."""
    shutil.copytree(directory, copy)
    meta = torch.load(copy / "meta.pt", weights_only=False)
    state = _determinism_state(meta)
    assert state.pop("train_loaders")
    state.pop("digest")  # an edit on purpose
    torch.save(meta, copy / "meta.pt")
    return copy


@pytest.fixture(scope="module")
def two(tmp_path_factory, fit_process) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp2")
    # the runs that need no other run's checkpoint, then those that resume one
    chain = {
        "A": ["--health", "--ckpt-every", "4"],
        "C": [
            "--health",
            "--snapshot-dir",
            str(root / "C" / "snapshots"),
            "--fault-rank",
            "1",
            "--fault-step",
            str(FAULT_STEP),
            "--truncate-snapshot-rank",
            "0",
        ],
        "L": ["--health", "--nan-op-rank", "1", "--fault-step", "4", "--max-epochs", "1"],
        "K": ["--health", "--ckpt-every", "4", "--kill-at", "9"],  # last: SIGKILLed, with the launch
    }
    runs = _run_together(fit_process, root, {"AK": chain}, may_fail=("AK",))
    assert (runs["L"] / "rank0.json").exists(), "the chain ended before K"
    stripped = _without_loader_position(runs["K"] / "ckpt-step8", root / "stripped")
    resumes = {
        "NR": {
            "N": ["--health", "--resume", str(stripped)],
            "R": ["--health", "--resume", str(runs["K"] / "ckpt-step8")],
        },
        "W": ["--devices", "1", "--resume", str(runs["A"] / "ckpt-step8")],
    }
    runs.update(_run_together(fit_process, root, resumes, may_fail=("W",)))
    return runs


def test_comparison_detects_one_ulp():
    a = {"w": torch.ones(3)}
    b = {"w": torch.ones(3)}
    b["w"][1] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    assert not _bitwise_equal(a, b)


def test_two_runs_write_bitwise_equal_sharded_checkpoints(two, tmp_path):
    # A ran to the end, K was killed at step 9: their step-8 directories (every rank's shards of the
    # weights and the AdamW state) are equal, and so are the losses of the steps both took
    loaded = []
    for name in ("A", "K"):
        dcp_to_torch_save(two[name] / "ckpt-step8", tmp_path / f"{name}.pt")
        loaded.append(torch.load(tmp_path / f"{name}.pt", weights_only=False))
    assert _bitwise_equal(loaded[0]["state_dict"], loaded[1]["state_dict"])
    for key, state in loaded[0]["optimizer_0"]["state"].items():
        assert _bitwise_equal(state, loaded[1]["optimizer_0"]["state"][key])
    assert _rank(two["A"], 0)["global_step"] == STEPS
    assert _bitwise_equal(_weights(two["A"], 0), _weights(two["A"], 1))  # the gathered full weights agree


def test_sigkill_mid_epoch_and_resume_is_bitwise_equal(two):
    assert not (two["K"] / "rank0.json").exists()  # K died (every rank) before finishing
    for rank in (0, 1):
        assert _bitwise_equal(_weights(two["R"], rank), _weights(two["A"], rank))
        assert _rank(two["R"], rank)["trace"] == _rank(two["A"], rank)["trace"][8:]  # losses of steps 8..11


def test_resume_without_the_loader_position_differs(two):
    # negative control: the same checkpoint without DeterminismCallback's loader position
    assert _rank(two["N"], 0)["global_step"] == STEPS
    assert not _bitwise_equal(_weights(two["N"], 0), _weights(two["A"], 0))


def test_checkpoint_records_every_rank_rng_mesh_and_shard_digests(two):
    state = _determinism_state(torch.load(two["A"] / "ckpt-step8" / "meta.pt", weights_only=False))
    assert state["mesh"] == {"data_parallel": 2, "tensor_parallel": 1}
    assert len(state["rng_per_rank"]) == 2
    assert not torch.equal(state["rng_per_rank"][0]["torch"], state["rng_per_rank"][1]["torch"])
    shards = state["digest"]["model_shards"]
    assert len(shards) == 2 and shards[0] != shards[1]


def test_nan_on_one_rank_shard_with_a_corrupt_snapshot_rolls_back_every_rank(two):
    records = [_rank(two["C"], rank) for rank in (0, 1)]
    assert records[1]["injections"] == [[FAULT_STEP, "gradient"]] and records[0]["injections"] == []
    assert records[1]["incidents"] == [{"step": FAULT_STEP, "reason": "nonfinite_grad", "outcome": "transient"}]
    assert records[0]["incidents"] == [{"step": FAULT_STEP, "reason": "other_rank", "outcome": "transient"}]
    # rank 0 cannot read its newest snapshot (step 4): both ranks restore the one of step 0
    assert any(kind == "corrupt_snapshot" for kind, _ in records[0]["events"])
    assert not any(kind == "corrupt_snapshot" for kind, _ in records[1]["events"])
    for record in records:
        assert [step for kind, step in record["events"] if kind == "rollback"] == [0]
        assert [row[0] for row in record["trace"]].count(FAULT_STEP) == 2
    for rank in (0, 1):
        assert _bitwise_equal(_weights(two["C"], rank), _weights(two["A"], rank))  # as if no fault


def test_reproducible_nan_on_one_rank_is_located_by_op_and_module_path_on_every_rank(two):
    # aten.log in net.0's forward on rank 1 at step 4, every time: the locator replays the step on both
    # ranks (the sharded forward and backward are collectives), and the origin is reported on both
    records = [_rank(two["L"], rank) for rank in (0, 1)]
    located = {"classification": "reproducible", "op": "aten.log.default", "module_path": "net.0"}
    for record in records:
        assert record["diagnoses"] == [located]
        assert [incident["outcome"] for incident in record["incidents"]] == ["recovered"]
        assert record["global_step"] == 6
    assert records[0]["events"] == records[1]["events"]  # the same decisions, in lockstep
    assert ["diagnosis", 4] in records[0]["events"] and ["policy", 4] in records[0]["events"]
    log = (two["A"] / "log.txt").read_text()  # the chain's output; only L makes aten.log give NaN
    assert "on rank 1: first non-finite (NaN) output: aten.log.default in forward" in log


def test_resume_on_another_mesh_is_refused_naming_both(two):
    log = (two["W"] / "log.txt").read_text()
    assert "ShardingLayoutMismatchError" in log
    assert "data_parallel=2 x tensor_parallel=1 (2 processes)" in log
    assert "data_parallel=1 x tensor_parallel=1 (1 process)" in log
    assert not (two["W"] / "rank0.json").exists()


@pytest.fixture(scope="module")
def four(tmp_path_factory, fit_process) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp2_4")
    chain = {
        "A4": ["--devices", "4", "--no-reseed", "--ckpt-every", "2"],
        "T4": ["--devices", "4", "--tensor-parallel", "2", "--health"],
    }
    runs = _run_together(fit_process, root, {"AT4": chain})
    resume = ["--devices", "4", "--no-reseed", "--resume", str(runs["A4"] / "ckpt-step4")]
    runs.update(_run_together(fit_process, root, {"R4": resume}))
    return runs


def test_four_ranks_resume_bitwise_from_their_own_rng_states(four):
    state = _determinism_state(torch.load(four["A4"] / "ckpt-step4" / "meta.pt", weights_only=False))
    rngs = [rank_rng["torch"] for rank_rng in state["rng_per_rank"]]
    assert len(rngs) == 4 and not any(torch.equal(rngs[0], other) for other in rngs[1:])  # rank 0's alone is wrong
    for rank in range(4):
        assert _bitwise_equal(_weights(four["R4"], rank), _weights(four["A4"], rank))
        assert _rank(four["R4"], rank)["trace"] == _rank(four["A4"], rank)["trace"][4:]


def test_data_and_tensor_parallel_ranks_share_batches_within_a_tensor_parallel_group(four):
    traces = [_rank(four["T4"], rank)["trace"] for rank in range(4)]
    assert traces[0] == traces[1] and traces[2] == traces[3]  # mesh (data, tensor): ranks 0, 1 form one group
    assert traces[0] != traces[2]
    assert len(traces[0]) == STEPS
    assert all(_bitwise_equal(_weights(four["T4"], rank), _weights(four["T4"], 0)) for rank in range(1, 4))
