"""FSDP2 (``fully_shard``, ``ModelParallelStrategy``) on one GPU: bitwise runs in fp32 and bf16-mixed, exact resume.

Runs ``_fsdp2_run.py`` with ``--accelerator cuda --devices 1`` (NCCL, a one-rank mesh: the sharded code
path with DTensor parameters and optimizer state); skipped without a CUDA device. What the
multi-process CPU tests check with gloo (``test_model_parallel_multiprocess.py``) needs a machine with
several GPUs for NCCL; run that file's scenarios there with ``--accelerator cuda``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("_fsdp2_run.py")
GPU = ["--accelerator", "cuda", "--devices", "1"]

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _run(fit_process, out: Path, *args: str, expect_ok: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    process = fit_process(SCRIPT, ["--out", str(out), *GPU, *args], log_path=out / "log.txt", cwd=out)
    code = process.wait()
    if expect_ok:
        assert code == 0, process.output_tail()
    return out


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "weights_rank0.pt", weights_only=True)


def _trace(out: Path) -> list:
    return json.loads((out / "rank0.json").read_text())["trace"]


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_two_sharded_runs_on_one_gpu_are_bitwise_equal(tmp_path, fit_process, precision):
    first = _run(fit_process, tmp_path / "a", "--health", "--precision", precision)
    second = _run(fit_process, tmp_path / "b", "--health", "--precision", precision)
    assert _bitwise_equal(_weights(first), _weights(second))
    assert _trace(first) == _trace(second) and len(_trace(first)) == 24  # 48 samples, batch 4, 2 epochs
    # negative control: the runs trained (the weights moved from the seeded start)
    start = _run(fit_process, tmp_path / "start", "--max-epochs", "0", "--precision", precision)
    assert not _bitwise_equal(_weights(first), _weights(start))


def test_sharded_run_on_one_gpu_resumes_bitwise_after_sigkill(tmp_path, fit_process):
    clean = _run(fit_process, tmp_path / "clean", "--health", "--ckpt-every", "4")
    killed = _run(fit_process, tmp_path / "killed", "--health", "--ckpt-every", "4", "--kill-at", "14", expect_ok=False)
    resumed = _run(fit_process, tmp_path / "resumed", "--health", "--resume", str(killed / "ckpt-step12"))
    assert _bitwise_equal(_weights(resumed), _weights(clean))
    assert _trace(resumed) == _trace(clean)[12:]
