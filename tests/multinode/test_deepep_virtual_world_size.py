"""DeepEP with ``virtual_world_size=4``: 1, 2 and 4 gloo processes train and log bit for bit alike.

The runs (``_deepep_virtual_run.py``: CartPole, 4 environments, 6 timesteps, hidden size 8, 6 optimizer
steps over two epochs) give each process ``4 / W`` virtual ranks, whose rollouts are keyed by the
virtual rank; the strategy adds the four micro-batch gradients in virtual-rank order and the module
logs the ordered mean of the four virtual ranks. Negative control: without ``virtual_world_size`` the
rollouts follow the processes, so one and two processes train different weights. Runs of the same process
count fit in turn in one launch (``--then``): each negative control first, as a fresh run, then the
virtual run, which must still equal the others.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.deepep.config import DeepEPConfig, grouped
from deepep_lightning.deepep.virtual_ranks import check_virtual_support, ordered_mean

SCRIPT = Path(__file__).with_name("_deepep_virtual_run.py")
VIRTUAL = 4
STEPS = 6
SAVED_AT = 2  # mid-epoch (4 optimizer steps per epoch)


def _args(directory: Path, processes: int, virtual: int | None, *extra: str) -> list[str]:
    directory.mkdir()
    args = ["--out", str(directory), "--devices", str(processes), "--max-steps", str(STEPS), *extra]
    return args + (["--virtual", str(virtual)] if virtual is not None else [])


def _run_together(fit_process, root: Path, launches: dict[str, dict[str, tuple]]) -> dict[str, Path]:
    """Start every launch at once, each fitting its runs (name: ``(processes, virtual, *extra)``, in
    ``root / name``) in turn in the same processes; each must exit 0. The directory of every run."""
    started = {}
    for launch, runs in launches.items():
        args: list[str] = []
        for name, run in runs.items():
            args += [*(["--then"] if args else []), *_args(root / name, *run)]
        first = root / next(iter(runs))
        started[launch] = fit_process(SCRIPT, args, log_path=first / "log.txt", cwd=first)
    for launch, code in fit_process.wait_all(started).items():
        assert code == 0, f"{launch}: exit code {code}\n{started[launch].output_tail()}"
    return {name: root / name for runs in launches.values() for name in runs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fit_process) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepep_virtual")
    out = _run_together(
        fit_process,
        root,
        {
            "one": {"plain1": (1, None), "virtual1": (1, VIRTUAL)},
            "two": {"plain2": (2, None), "virtual2": (2, VIRTUAL, "--save-at", str(SAVED_AT))},
            "four": {"virtual4": (4, VIRTUAL)},
        },
    )
    resume = ("--resume", str(out["virtual2"] / f"step{SAVED_AT}.ckpt"))
    out.update(_run_together(fit_process, root, {"resumed2": {"resumed2": (2, VIRTUAL, *resume)}}))
    return out


def _records(directory: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(directory.glob("rank*.json"))]


def _weights(directory: Path) -> torch.Tensor:
    state = torch.load(directory / "weights_rank0.pt", weights_only=True)
    return torch.cat([value.flatten().double() for value in state.values()])


def _micro_batches(directory: Path) -> list[list]:
    """``[step, virtual rank, loss]`` of every rollout, ordered by step then virtual rank."""
    return sorted((row for record in _records(directory) for row in record["micro"]), key=lambda r: (r[0], r[1]))


def test_ordered_mean_adds_in_row_order():
    rows = torch.tensor([[1e8], [1.0], [-1e8], [1.0]])  # float32: 1e8 + 1 rounds back to 1e8
    assert ordered_mean(rows).item() == 0.25  # (((1e8 + 1) - 1e8) + 1) / 4
    assert ((rows[0] + rows[1]) + (rows[2] + rows[3])).item() / 4 != 0.25  # another association: other bits


@pytest.mark.parametrize("name, value", [("cuda_graph", True), ("compile_step", True), ("target_entropy", 0.5)])
def test_refuses_per_process_options(name, value):
    with pytest.raises(MisconfigurationException, match=rf"{name}={value!r}.*virtual_world_size"):
        check_virtual_support(DeepEPConfig(**grouped(**{name: value})))
    check_virtual_support(DeepEPConfig())


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_one_two_and_four_processes_are_bitwise_equal(runs):
    one = _micro_batches(runs["virtual1"])
    assert [row[:2] for row in one] == [[s, v] for s in range(STEPS) for v in range(VIRTUAL)]
    logged = _records(runs["virtual1"])[0]["logged"]
    assert [row[0] for row in logged] == list(range(1, STEPS + 1))
    assert any(row[2] != "nan" for row in logged)  # episodes finished: the rolling return is compared too
    final = _records(runs["virtual1"])[0]["final_metrics"]
    assert "train/episode_return" in final
    for processes in (2, 4):
        records = _records(runs[f"virtual{processes}"])
        assert len(records) == processes
        assert _micro_batches(runs[f"virtual{processes}"]) == one  # every virtual rank's loss at every step
        assert all(record["logged"] == logged for record in records)  # logged scalars, on every process
        assert all(record["final_metrics"] == final for record in records)
        assert torch.equal(_weights(runs[f"virtual{processes}"]), _weights(runs["virtual1"]))
        per_process = VIRTUAL // processes
        assert [r["rollout_state_ranks"] for r in records] == [
            list(range(rank * per_process, (rank + 1) * per_process)) for rank in range(processes)
        ]
        assert {r["fingerprint"]["ddp.virtual_world_size"] for r in records} == {"4"}


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_a_resume_continues_every_virtual_rank(runs):
    """Two processes resumed mid-epoch: each virtual rank's environments and recurrent state carry on."""
    uninterrupted, resumed = _records(runs["virtual2"]), _records(runs["resumed2"])
    for before, after in zip(uninterrupted, resumed, strict=True):
        assert after["logged"] == before["logged"][SAVED_AT:]  # steps SAVED_AT + 1 ... STEPS
        assert after["micro"] == before["micro"][SAVED_AT * (VIRTUAL // 2) :]
    assert [row[0] for row in resumed[0]["logged"]] == list(range(SAVED_AT + 1, STEPS + 1))
    assert torch.equal(_weights(runs["resumed2"]), _weights(runs["virtual2"]))


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_without_virtual_world_size_the_process_count_changes_the_weights(runs):
    assert _records(runs["plain1"])[0]["rollout_state_ranks"] == []  # the default path: one rollout per process
    assert not torch.equal(_weights(runs["plain1"]), _weights(runs["plain2"]))
