"""PreemptionCallback with real processes and real signals: 0 steps lost, a non-zero exit, a bitwise resume.

Single process (``tests/determinism/_run_fit.py``, checkpoints every 5 steps): SIGTERM arrives at a
random step between two checkpoints. With the callback the run exits 143 with a checkpoint of the
step the signal arrived in, and the resumed run equals the uninterrupted one bitwise (model and
optimizer tensors). Negative control: the same signal without the callback ends with Lightning's
exit code 0, and the newest checkpoint is the older periodic one (the steps since are lost).

Two gloo ranks (``tests/strategies/_ddp_run.py``, ``ddp_deterministic``): SIGUSR1 reaches rank 1
only; both ranks stop at the same step with exit code 138 (no hang: a hard timeout would fail the
test), and the resume equals the uninterrupted 2-process run bitwise on both ranks.

Each signalled run fits after its uninterrupted run in the same processes (``--then``; the signal ends
them): the uninterrupted run is the first fit there, and the resume, in a fresh process, must equal it.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
from pathlib import Path

import pytest
import torch

from deepep_lightning.checkpointing import exit_code_for

pytestmark = pytest.mark.slow

_TESTS = Path(__file__).resolve().parents[1]
_FIT = _TESTS / "determinism" / "_run_fit.py"
_DDP = _TESTS / "strategies" / "_ddp_run.py"
_CKPT_EVERY = 5
# the batch after step N gets the signal; step N + 1 is then the newest step, never a periodic checkpoint's
_SIGNAL_AT = random.choice([n for n in range(_CKPT_EVERY, 18) if (n + 1) % _CKPT_EVERY])
_DDP_SIGNAL_AT = random.choice([1, 2, 5, 6])  # 4 steps per epoch, 8 in all: mid-epoch, either epoch


def _fit_args(out: Path, *extra: str) -> list[str]:
    return ["--module", "plain", "--out", str(out), "--tb", str(out / "tb"), "--ckpt-every", str(_CKPT_EVERY), *extra]


def _ddp_args(out: Path, *extra: str) -> list[str]:
    return ["--out", str(out), "--no-health", "--determinism", *extra]


def _wait(processes: dict, expected: dict[str, int]) -> None:
    for name, (process, _) in processes.items():
        code = process.wait()
        assert code == expected[name], f"{name}: exit code {code}, expected {expected[name]}\n{process.output_tail()}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, fit_process) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("preemption")
    sigterm = ["--signal-at", str(_SIGNAL_AT), "--signal", "SIGTERM"]
    sigusr1 = ["--signal-rank", "1", "--signal-at", str(_DDP_SIGNAL_AT), "--signal", "SIGUSR1"]
    for name in ("full", "ddp_full"):
        (root / name).mkdir()
    first = {  # the uninterrupted runs first, in the processes of the signalled runs (in whose logs they print)
        "preempted": (
            _FIT,
            [*_fit_args(root / "full"), "--then", *_fit_args(root / "preempted", "--preemption", *sigterm)],
        ),
        "unhandled": (_FIT, _fit_args(root / "unhandled", *sigterm)),
        "ddp_preempted": (
            _DDP,
            [*_ddp_args(root / "ddp_full"), "--then", *_ddp_args(root / "ddp_preempted", "--preemption", *sigusr1)],
        ),
    }

    def start(batch: dict) -> dict:
        started = {}
        for name, (script, args) in batch.items():
            out = root / name
            out.mkdir(exist_ok=True)
            started[name] = (fit_process(script, args, log_path=out / "log.txt", cwd=out), out)
        return started

    _wait(
        start(first),
        {"preempted": 143, "unhandled": 0, "ddp_preempted": exit_code_for(signal.SIGUSR1)},
    )
    for name in ("preempted", "ddp_preempted"):
        shutil.copytree(root / name, root / f"{name}_resumed")
    second = {
        name: (script, make_args(root / name, "--resume", str(root / name / "last.ckpt")))
        for name, script, make_args in [
            ("preempted_resumed", _FIT, _fit_args),
            ("ddp_preempted_resumed", _DDP, _ddp_args),
        ]
    }
    _wait(start(second), {name: 0 for name in second})
    return {name: root / name for name in ["full", "ddp_full", *first, *second]}


def _step(checkpoint: Path) -> int:
    return int(torch.load(checkpoint, weights_only=False, map_location="cpu")["global_step"])


def _final(out: Path) -> dict[str, torch.Tensor]:
    saved = torch.load(out / "final.pt", weights_only=True)
    return {f"{part}.{key}": value for part, values in saved.items() for key, value in values.items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_sigterm_checkpoints_the_step_it_arrived_in_and_exits_143(runs: dict[str, Path]) -> None:
    # the signal came at the start of step _SIGNAL_AT + 1; that step finished and is in the checkpoint
    assert _step(runs["preempted"] / "last.ckpt") == _SIGNAL_AT + 1, f"signal at step {_SIGNAL_AT}"
    assert "PreemptionCallback: SIGTERM received" in (runs["preempted"] / "log.txt").read_text()
    assert not list(runs["preempted"].glob("*.tmp.*")), "a temporary file was left beside the checkpoint"


def test_resume_after_sigterm_loses_no_step_and_is_bitwise_equal(runs: dict[str, Path]) -> None:
    assert _equal(_final(runs["full"]), _final(runs["preempted_resumed"])), f"signal at step {_SIGNAL_AT}"


def test_negative_control_without_the_callback_exits_0_and_loses_steps(runs: dict[str, Path]) -> None:
    newest = _step(runs["unhandled"] / "last.ckpt")
    assert newest == (_SIGNAL_AT + 1) // _CKPT_EVERY * _CKPT_EVERY < _SIGNAL_AT + 1, f"signal at step {_SIGNAL_AT}"
    assert not (runs["unhandled"] / "final.pt").exists(), "Lightning's SIGTERM handling ends the fit early"


def test_a_signal_on_one_rank_stops_both_ranks_at_the_same_step(runs: dict[str, Path]) -> None:
    out = runs["ddp_preempted"]
    stopped = [json.loads((out / f"stopped_rank{rank}.json").read_text()) for rank in (0, 1)]
    expected = {"global_step": _DDP_SIGNAL_AT + 1, "code": exit_code_for(signal.SIGUSR1)}
    assert stopped == [expected, expected], f"SIGUSR1 to rank 1 at step {_DDP_SIGNAL_AT}"
    assert _step(out / "last.ckpt") == _DDP_SIGNAL_AT + 1


def test_ddp_resume_after_the_signal_is_bitwise_equal_on_both_ranks(runs: dict[str, Path]) -> None:
    for rank in (0, 1):
        full = torch.load(runs["ddp_full"] / f"weights_rank{rank}.pt", weights_only=True)
        resumed = torch.load(runs["ddp_preempted_resumed"] / f"weights_rank{rank}.pt", weights_only=True)
        assert _equal(full, resumed), f"rank {rank}, SIGUSR1 to rank 1 at step {_DDP_SIGNAL_AT}"
