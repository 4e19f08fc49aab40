"""benchmarks/bench_tax_ablation.py on the CPU: every setting measured and profiled, each switched as it says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_tax_ablation  # noqa: E402


def test_the_driver_times_and_profiles_every_setting(tmp_path, run_process):
    command = [sys.executable, str(REPO / "benchmarks" / "bench_tax_ablation.py"), "--model", "tiny_mlp"]
    command += ["--device", "cpu", "--rounds", "2", "--steps", "2", "--out", str(tmp_path)]
    finished = run_process(command)
    assert finished.returncode == 0, finished.stderr[-2000:]
    result = json.loads((tmp_path / "tiny_mlp.json").read_text())
    assert list(result["summary"]) == list(bench_tax_ablation.SETTINGS)
    assert result["summary"]["plain"]["ratio"] == 1.0
    for name, record in result["settings"].items():
        assert len(record["step_ms"]) == 4 and all(ms > 0 for ms in record["step_ms"]), name
        assert any(row["name"].startswith("aten::") for row in record["host"]), name


def test_each_setting_switches_what_it_names():
    from deepep_lightning.ops import refused_ops_patched

    before = torch.are_deterministic_algorithms_enabled(), refused_ops_patched()
    try:
        bench_tax_ablation.apply_setting("det")
        assert torch.are_deterministic_algorithms_enabled() and not refused_ops_patched()
        bench_tax_ablation.apply_setting("det_routes_env")
        assert refused_ops_patched() and bench_tax_ablation.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        bench_tax_ablation.apply_setting("plain")
        assert not torch.are_deterministic_algorithms_enabled() and not refused_ops_patched()
        assert "CUBLAS_WORKSPACE_CONFIG" not in bench_tax_ablation.os.environ
        with pytest.raises(ValueError, match="name must be one of"):
            bench_tax_ablation.apply_setting("fast")
    finally:
        torch.use_deterministic_algorithms(before[0])
        from deepep_lightning.ops import patch_refused_ops

        patch_refused_ops(before[1])
