"""ordered_reduction: rank-ordered gradient averaging, against DDP's all-reduce on 4 gloo processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepep_lightning.strategies.ordered_reduction import ordered_sum

SCRIPT = Path(__file__).with_name("_reduction_run.py")


def test_ordered_sum_adds_rows_in_order():
    rows = torch.tensor([[1e8], [1.0], [-1e8]])  # float32: 1e8 + 1 rounds back to 1e8
    assert ordered_sum(rows).item() == 0.0  # ((1e8 + 1) - 1e8)
    assert ordered_sum(rows[[0, 2, 1]]).item() == 1.0  # negative control: another order, other bits
    assert ordered_sum(rows[:1]).data_ptr() != rows.data_ptr()  # a fresh tensor, the input untouched


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_ordered_hook_is_independent_of_the_bucket_layout(tmp_path, fit_process):
    out = tmp_path / "reduction.json"
    process = fit_process(SCRIPT, [str(out)], log_path=tmp_path / "log.txt", cwd=tmp_path)
    assert process.wait() == 0, process.output_tail()
    result = json.loads(out.read_text())
    # DDP's all-reduce: the first step (one bucket) and a later one (rebuilt buckets) differ in bits
    assert result["allreduce"] == {"restart_equal": False, "ordered_sum_equal": False, "mean_close": True}
    # the ordered hook: the same bits in both layouts, exactly the rank-ordered sum over 4
    assert result["ordered"] == {"restart_equal": True, "ordered_sum_equal": True, "mean_close": True}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_ordered_hook_on_two_gpus_with_nccl(tmp_path, fit_process):
    # NCCL with two ranks: each element is one addition, so both modes repeat across the bucket rebuild
    out = tmp_path / "reduction.json"
    args = [str(out), "--backend", "nccl", "--world-size", "2"]
    process = fit_process(SCRIPT, args, log_path=tmp_path / "log.txt", cwd=tmp_path)
    assert process.wait() == 0, process.output_tail()
    result = json.loads(out.read_text())
    assert result["ordered"] == {"restart_equal": True, "ordered_sum_equal": True, "mean_close": True}
    assert result["allreduce"]["restart_equal"] and result["allreduce"]["mean_close"]
