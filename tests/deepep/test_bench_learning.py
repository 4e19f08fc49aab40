"""benchmarks/bench_learning.py on the CPU: a memory run stops at its wall-time budget, or runs all its steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _bench(run_process, out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "benchmarks/bench_learning.py", "--out", str(out), "--device", "cpu", "--quick"]
    command += ["--seeds", "--memory-horizons", "8", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return run_process(command, cwd=REPO, env=env)


def _memory_run(run_process, out: Path, *extra: str) -> dict:
    done = _bench(run_process, out, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads((out / "learning_gpu.json").read_text())["memory"]
    return run


@pytest.mark.slow  # two fresh processes
def test_a_memory_run_stops_at_the_first_checkpoint_after_its_time_budget(tmp_path, run_process):
    budgeted = _memory_run(run_process, tmp_path / "budget", "--memory-seconds", "0.001")
    assert budgeted["seconds_budget"] == 0.001
    assert budgeted["steps_run"] == 25 and [point[0] for point in budgeted["checkpoints"]] == [25]
    # negative control: without a budget the run goes through the quick budget's 50 steps
    whole = _memory_run(run_process, tmp_path / "whole")
    assert whole["seconds_budget"] is None
    assert whole["steps_run"] == 50 and [point[0] for point in whole["checkpoints"]] == [25, 50]


def test_a_budget_that_is_not_positive_is_refused_by_name(tmp_path, run_process):
    done = _bench(run_process, tmp_path, "--memory-seconds", "0")
    assert done.returncode == 2 and "--memory-seconds must be > 0, got 0.0" in done.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_step_scalars_copy_each_steps_outputs_and_read_them_in_step_order(dtype, monkeypatch):
    """The benchmark reads the per-step scalars once per checkpoint; a CUDA-graph step overwrites the same output
    tensors at every replay, so each step's values must be copied when they are added."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_learning

    total, episodes = torch.zeros((), dtype=dtype), torch.zeros((), dtype=torch.int64)
    scalars = bench_learning.StepScalars()
    for step in range(5):
        total.fill_(10.0 * step)  # one output tensor, overwritten in place, as by a graph replay
        episodes.fill_(step)
        scalars.add({"episode_return_sum": total, "episodes": episodes})
    assert scalars.read() == [(10.0 * step, float(step)) for step in range(5)]
    assert scalars.read() == []  # read once
