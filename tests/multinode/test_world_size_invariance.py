"""World-size invariance with ``virtual_world_size=4``: 1, 2 and 4 gloo processes train bit for bit alike.

The runs reuse ``tests/strategies/_ddp_run.py`` (a small MLP, augmentation noise from the per-micro-batch
stream, a shuffled loader): ``W`` processes accumulate ``4 / W`` micro-batches each. One process adds
the four micro-batch gradients in order through autograd's accumulation; two keep them apart and add
the gathered rows in the same order (``MicroBatchGradients``); four sum through the ordered hook.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepep_lightning.strategies.micro_batch_gradients import MicroBatchGradients

SCRIPT = Path(__file__).parents[1] / "strategies" / "_ddp_run.py"
VIRTUAL = 4


def test_micro_batch_rows_are_added_in_order():
    weight = torch.nn.Parameter(torch.zeros(1))
    gradients = MicroBatchGradients([weight], micro_batches=4, world_size=1)
    for index, value in enumerate([1e8, 1.0, -1e8, 1.0]):  # float32: 1e8 + 1 rounds back to 1e8
        weight.grad = torch.tensor([value])
        gradients.keep(index)
        assert weight.grad.item() == 0.0  # the next micro-batch starts from zero
    gradients.reduce_into_grads()
    assert weight.grad.item() == 1.0  # ((1e8 + 1) - 1e8) + 1, as one process accumulates
    # negative control: the two-process association (a + b) + (c + d) gives other bits
    a, b, c, d = (torch.tensor([v]) for v in (1e8, 1.0, -1e8, 1.0))
    assert ((a + b) + (c + d)).item() != weight.grad.item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fit_process) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("invariance")
    started = {}
    for processes in (1, 2, 4):  # all at once
        directory = root / f"w{processes}"
        directory.mkdir()
        args = ["--out", str(directory), "--devices", str(processes), "--accumulate", str(VIRTUAL // processes)]
        args += ["--no-health", "--strategy-kwargs", json.dumps({"virtual_world_size": VIRTUAL})]
        started[processes] = fit_process(SCRIPT, args, log_path=directory / "log.txt", cwd=directory)
    for processes, code in fit_process.wait_all(started).items():
        assert code == 0, started[processes].output_tail()
    return {processes: root / f"w{processes}" for processes in started}


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return torch.load(directory / "weights_rank0.pt", weights_only=True)


def _micro_batches(directory: Path, processes: int) -> list[list]:
    """``(step, loss, noise sum, indices)`` of every micro-batch, in virtual-rank order within each step."""
    traces = [json.loads((directory / f"rank{rank}.json").read_text())["trace"] for rank in range(processes)]
    per_process = VIRTUAL // processes
    steps = len(traces[0]) // per_process
    return [traces[v // per_process][s * per_process + v % per_process] for s in range(steps) for v in range(VIRTUAL)]


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_one_two_and_four_processes_are_bitwise_equal(runs):
    one = _micro_batches(runs[1], 1)
    assert len(one) == 4 * VIRTUAL  # 4 optimizer steps of 4 micro-batches
    for processes in (2, 4):
        assert _micro_batches(runs[processes], processes) == one  # data, noise and losses of every micro-batch
        assert torch.equal(
            torch.cat([w.flatten() for w in _weights(runs[processes]).values()]),
            torch.cat([w.flatten() for w in _weights(runs[1]).values()]),
        )
    records = [json.loads((runs[p] / "rank0.json").read_text()) for p in (1, 2, 4)]
    assert [r["fingerprint"]["ddp.virtual_world_size"] for r in records] == ["4", "4", "4"]
