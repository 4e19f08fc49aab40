"""Tests of the suite's one subprocess runner (tests/conftest.py): a deadline that moves with progress.

A child that keeps printing outlives its idle limit many times over; a silent, idle child fails the
test after the limit, and its whole session (a grandchild too) is killed; a silent child that computes
is seen using CPU, which also counts as progress, also when two busy processes slow it down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

_PRINTS_FOR_4_S = "import time\nfor _ in range(16):\n    print('step', flush=True)\n    time.sleep(0.25)"
_SLEEPS_WITH_A_GRANDCHILD = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(120)"
)


def test_a_child_that_keeps_printing_outlives_its_idle_limit(run_process):
    started = time.monotonic()
    done = run_process([sys.executable, "-c", _PRINTS_FOR_4_S], idle_timeout_s=2)
    assert done.returncode == 0 and done.stdout.count("step") == 16
    assert time.monotonic() - started > 2  # longer than the limit: the deadline moved


def test_a_silent_idle_child_fails_the_test_and_its_session_is_killed(tmp_path, child_process):
    """Negative control: no output, no CPU for the limit."""
    process = child_process([sys.executable, "-c", _SLEEPS_WITH_A_GRANDCHILD], stdout_path=tmp_path / "out.txt")
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"made no progress \(no output, no CPU\) for 2 s"):
        process.wait(idle_timeout_s=2)
    assert time.monotonic() - started < 60
    assert process.process.returncode == -9
    grandchild = int((tmp_path / "out.txt").read_text().split()[0])
    for _ in range(50):  # the grandchild is killed with the session; init reaps it
        if not os.path.exists(f"/proc/{grandchild}") or " Z " in open(f"/proc/{grandchild}/stat").read():
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {grandchild} outlived the session")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_silent_computing_child_is_seen_using_cpu(tmp_path, child_process):
    burn = "import time\nend = time.process_time() + 1.0\nwhile time.process_time() < end:\n    pass"
    computing = child_process([sys.executable, "-c", burn], stdout_path=tmp_path / "burn.txt")
    sleeping = child_process([sys.executable, "-c", "import time; time.sleep(30)"], stdout_path=tmp_path / "sleep.txt")
    try:
        deadline = time.monotonic() + 60
        while computing.cpu_seconds() < 0.8 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert computing.cpu_seconds() >= 0.8
        assert computing.wait(idle_timeout_s=60) == 0
        # negative control: a sleeping session uses (next to) none
        assert sleeping.cpu_seconds() < 0.5
    finally:
        sleeping.kill()
        sleeping.process.wait()


@pytest.mark.slow
def test_a_silent_child_slowed_by_two_busy_processes_passes_where_a_fixed_limit_fails(
    tmp_path, child_process, run_process
):
    """The load check: two CPU-bound processes compete with a child that computes 4 CPU-seconds without
    output. Its idle limit (3 s) is shorter than its run, yet it passes; a fixed 3 s limit kills it."""
    spin = [sys.executable, "-c", "while True:\n    pass"]
    busy = [child_process(spin, stdout_path=tmp_path / f"busy{index}.txt") for index in range(2)]
    work = "import time\nend = time.process_time() + 4.0\nwhile time.process_time() < end:\n    pass"
    try:
        started = time.monotonic()
        assert run_process([sys.executable, "-c", work], idle_timeout_s=3).returncode == 0
        assert time.monotonic() - started > 3
    finally:
        for process in busy:
            process.kill()
            process.process.wait()
    # negative control: the same child under a wall-clock limit of the same length (no load needed)
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", work], timeout=3)
