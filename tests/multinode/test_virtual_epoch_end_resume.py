"""World-size-invariant mode resumes exactly from a checkpoint written at an epoch's end.

``_epoch_end_resume_run.py`` trains with ``DeterministicDDPStrategy(virtual_world_size=K)`` and
``max_steps``, writing a checkpoint in ``on_train_epoch_end``; a second run resumes from the first
epoch's checkpoint. With ``max_steps`` set Lightning re-enters the finished epoch on resume and trains
one extra batch from a fresh loader iterator, stepping on that single micro-batch; the strategy
(``on_train_start``, :func:`deepep_lightning._lightning_compat.finish_restored_epoch`) starts the next
epoch instead, so every micro-batch after the resume and the final weights equal the uninterrupted
run's. Negative control: resuming as Lightning alone does (``--lightning-restart``) trains that extra
batch and ends with other weights. The control and the resume fit in turn in one launch (``--then``): the
control first, as a fresh run, the resume after it, which must still equal the uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("_epoch_end_resume_run.py")


def _run_in_turn(fit_process, root: Path, runs: dict[str, list[str]]) -> dict[str, Path]:
    """Fit every run (name: arguments, in ``root / name``) in turn in one launch, which must exit 0."""
    args: list[str] = []
    for name, run_args in runs.items():
        (root / name).mkdir()
        args += [*(["--then"] if args else []), "--out", str(root / name), *run_args]
    first = root / next(iter(runs))
    process = fit_process(SCRIPT, args, log_path=first / "log.txt", cwd=first)
    assert process.wait() == 0, process.output_tail()
    return {name: root / name for name in runs}


def _micro(directory: Path, rank: int = 0) -> list[list]:
    return json.loads((directory / f"rank{rank}.json").read_text())["micro"]


def _weights_equal(a: Path, b: Path, rank: int = 0) -> bool:
    wa, wb = (torch.load(d / f"weights_rank{rank}.pt", weights_only=True) for d in (a, b))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize(
    ("module", "devices", "virtual"),
    [("tiny", 1, 2), ("deepep", 1, 2), ("deepep", 2, 4)],
    ids=["tiny-1proc", "deepep-1proc", "deepep-2proc"],
)
def test_epoch_end_resume_is_bitwise_exact(tmp_path, fit_process, module, devices, virtual):
    config = ["--module", module, "--devices", str(devices), "--virtual", str(virtual)]
    full = _run_in_turn(fit_process, tmp_path, {"full": config})["full"]
    resume = [*config, "--resume", str(full / "epoch0.ckpt")]
    resumes = _run_in_turn(fit_process, tmp_path, {"control": [*resume, "--lightning-restart"], "resumed": resume})
    resumed, control = resumes["resumed"], resumes["control"]
    for rank in range(devices):
        after = _micro(resumed, rank)
        assert after[0][:2] == [1, 0]  # the resume starts epoch 1 at its first batch
        assert after == _micro(full, rank)[-len(after) :]  # every micro-batch: epoch, index, step, loss bits
        assert _weights_equal(full, resumed, rank)
    # negative control: Lightning alone trains a batch of epoch 0 again, one micro-batch stepped alone
    epoch_zero_batches = sum(1 for row in _micro(full) if row[0] == 0)
    assert _micro(control)[0][:2] == [0, epoch_zero_batches]
    assert not _weights_equal(full, control)
