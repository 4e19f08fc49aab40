"""examples/plain_lightning.py does what its docstring says: two runs and a SIGKILL + resume are bitwise equal."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from deepep_lightning.compare import compare_runs

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "plain_lightning.py"

pytestmark = pytest.mark.slow


def _start(child_process, out: Path, *extra: str):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, str(EXAMPLE), "--out", str(out), "--max-steps", "36", "--num-workers", "1", *extra]
    log = f"{out.name}-{'resume' if '--resume' in extra else 'fit'}"
    stdout, stderr = out.parent / f"{log}.stdout", out.parent / f"{log}.stderr"
    return child_process(command, stdout_path=stdout, stderr_path=stderr, cwd=os.getcwd(), env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, child_process) -> dict[str, Path]:
    """Two runs (a, b), one with another seed (seed7) and one SIGKILLed at step 23, then resumed (c)."""
    root = tmp_path_factory.mktemp("plain_lightning")
    started = {
        "a": _start(child_process, root / "a"),
        "b": _start(child_process, root / "b"),
        "seed7": _start(child_process, root / "seed7", "--seed", "7"),
        "c": _start(child_process, root / "c", "--kill-at", "23"),
    }  # all at once
    codes = child_process.wait_all(started)
    for name, code in codes.items():
        expected = -signal.SIGKILL if name == "c" else 0
        assert code == expected, f"{name}: exit code {code}\n{started[name].output_tail()}"
    resumed = _start(child_process, root / "c", "--resume")
    assert resumed.wait() == 0, resumed.output_tail()
    return {name: root / name for name in started}


def test_two_runs_and_a_killed_resumed_run_are_bitwise_equal(runs):
    assert compare_runs([runs["a"] / "tb", runs["b"] / "tb"]).identical
    result = compare_runs([runs["a"] / "tb", runs["c"] / "tb"])
    assert result.identical, result.format_table()
    assert "train/loss" in result.compared_tags


def test_a_different_seed_differs(runs):
    """Negative control: the comparison can fail."""
    assert "train/loss" in compare_runs([runs["a"] / "tb", runs["seed7"] / "tb"]).differing_tags
