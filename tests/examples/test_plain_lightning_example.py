"""examples/plain_lightning.py does what its docstring says: two runs and a SIGKILL + resume are bitwise equal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deepep_lightning.compare import compare_runs

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "plain_lightning.py"

pytestmark = pytest.mark.slow


def _run(run_process, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, str(EXAMPLE), "--out", str(out), "--max-steps", "36", "--num-workers", "1", *extra]
    return run_process(command, env=env)


def test_two_runs_and_a_killed_resumed_run_are_bitwise_equal(tmp_path, run_process):
    for name in ("a", "b"):
        assert _run(run_process, tmp_path / name).returncode == 0
    killed = _run(run_process, tmp_path / "c", "--kill-at", "23")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = _run(run_process, tmp_path / "c", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    assert compare_runs([tmp_path / "a" / "tb", tmp_path / "b" / "tb"]).identical
    result = compare_runs([tmp_path / "a" / "tb", tmp_path / "c" / "tb"])
    assert result.identical, result.format_table()
    assert "train/loss" in result.compared_tags


def test_a_different_seed_differs(tmp_path, run_process):
    """Negative control: the comparison can fail."""
    assert _run(run_process, tmp_path / "a").returncode == 0
    assert _run(run_process, tmp_path / "b", "--seed", "7").returncode == 0
    assert "train/loss" in compare_runs([tmp_path / "a" / "tb", tmp_path / "b" / "tb"]).differing_tags
