"""destroy_process_group_at_exit: the default group is gone before the interpreter finalizes.

Each case is a fresh process with a one-rank gloo group that has run a collective. A probe registered
before the handler runs after it (``atexit`` is last in, first out) and records whether the group is
still alive. Negative control: without the handler the group outlives every ``atexit`` handler.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import atexit, json, sys
import torch
import torch.distributed as dist
from deepep_lightning.strategies.process_group_exit import destroy_process_group_at_exit

out, store, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
destroyed, handler_runs = [], []
destroy = dist.destroy_process_group
dist.destroy_process_group = lambda *args: destroyed.append(dist.is_initialized()) or destroy(*args)
dist.is_available = lambda: handler_runs.append(1) or True  # the handler's first call
atexit.register(lambda: open(out, "w").write(json.dumps([dist.is_initialized(), destroyed, len(handler_runs)])))
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
dist.all_reduce(torch.ones(4))
for _ in range(calls):
    destroy_process_group_at_exit()
"""


def _exit_state(run_process, tmp_path: Path, calls: int) -> list:
    out = tmp_path / "state.json"
    command = [sys.executable, "-c", _SCRIPT, str(out), str(tmp_path / "store"), str(calls)]
    completed = run_process(command, env=dict(os.environ))
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_group_is_destroyed_before_the_interpreter_finalizes(tmp_path, run_process):
    alive_at_exit, destroyed, handler_runs = _exit_state(run_process, tmp_path, calls=2)
    assert alive_at_exit is False
    assert destroyed == [True]  # destroyed while alive
    assert handler_runs == 1  # registered twice (fit, then test): one handler


@pytest.mark.slow
def test_without_the_handler_the_group_outlives_every_exit_handler(tmp_path, run_process):
    alive_at_exit, destroyed, handler_runs = _exit_state(run_process, tmp_path, calls=0)
    assert alive_at_exit is True
    assert destroyed == [] and handler_runs == 0
