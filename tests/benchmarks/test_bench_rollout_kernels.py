"""benchmarks/bench_rollout_kernels.py on the CPU: the block kernel timed per shape; the cluster kernel's columns
empty where it cannot run."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from deepep_lightning.ops import extension_available

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not extension_available(), reason="needs the compiled deepep extension")


def test_quick_run_times_the_block_kernel_for_both_policies(tmp_path, run_process):
    command = [sys.executable, str(REPO / "benchmarks" / "bench_rollout_kernels.py"), "--quick", "--out", str(tmp_path)]
    finished = run_process(command)
    assert finished.returncode == 0, finished.stderr[-2000:]
    result = json.loads((tmp_path / "rollout_kernels_quick.json").read_text())
    assert result["device"] == "cpu"
    assert [record["policy_reads_hidden"] for record in result["records"]] == [False, True]
    for record in result["records"]:
        assert (record["batch"], record["steps"]) == (8, 4)
        assert record["blocks4_ms"] > 0 and record["blocks8_ms"] > 0
        assert math.isclose(record["blocks4_us_per_timestep"], 1000 * record["blocks4_ms"] / 4, abs_tol=0.02)
        for name in ("clusters", "clusters16", "clusters24", "clusters32"):  # CUDA (Hopper) only
            assert record[f"{name}_ms"] is None and record[f"{name}_equal_blocks"] is None
