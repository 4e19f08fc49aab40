"""DeterministicDDPStrategy on 2 GPUs (NCCL): bitwise runs, lockstep rollback, 1-vs-2 invariance.

Runs ``benchmarks/bench_ddp.py`` without its timing runs; skipped without two CUDA devices.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.multigpu
def test_two_gpu_runs_bitwise_rollback_lockstep_and_invariance(tmp_path, run_process):
    env = dict(
        os.environ,
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
        PYTHONPATH=str(REPO),
    )
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "bench_ddp.py"),
        "--out",
        str(tmp_path),
        "--gpus",
        "2",
        "--steps",
        "15",
        "--fault-step",
        "17",
        "--runs",
        "det_a,det_b,fault,inv_1,inv_2",
    ]
    result = run_process(command, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "ddp.json").read_text())
    assert summary["bitwise_run_to_run"] is True
    assert summary["rollback_lockstep"] == {
        "all_ranks_rolled_back": True,
        "ranks_equal": True,
        "equal_to_clean_run": True,
    }
    assert summary["world_size_invariant_1_vs_2"] is True
