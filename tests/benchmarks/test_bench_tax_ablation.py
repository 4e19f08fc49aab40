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


def test_a_refused_setting_is_recorded_and_the_others_measured(monkeypatch):
    from zoo_models import ZooModel, ZooTask, select_models

    from deepep_lightning.ops import patch_refused_ops, refused_ops_patched

    (tiny,) = select_models(["tiny_mlp"])
    refusal = "planted_backward does not have a deterministic implementation, but you set it"

    def build(generator: torch.Generator) -> ZooTask:
        task = tiny.build(generator)

        def loss(model, batch):  # refused in plain deterministic mode, as nll_loss2d is on CUDA
            if torch.are_deterministic_algorithms_enabled() and not refused_ops_patched():
                raise RuntimeError(refusal)
            return task.loss(model, batch)

        return ZooTask(task.model, task.batches, loss)

    monkeypatch.setattr(bench_tax_ablation, "select_models", lambda names: [ZooModel("refusing", ("test",), (), build)])
    before = torch.are_deterministic_algorithms_enabled(), refused_ops_patched()
    try:
        result = bench_tax_ablation.run("refusing", torch.device("cpu"), 1, 2, bench_tax_ablation.SETTINGS)
        assert result["summary"]["det"] == {"refused": refusal}
        assert list(result["settings"]) == ["plain", "det_routes", "det_routes_env"]
        assert all(len(record["step_ms"]) == 2 for record in result["settings"].values())
        assert result["summary"]["det_routes"]["median_step_ms"] > 0

        refusal = "planted_backward: some other error"  # anything else is the model's failure and is raised
        with pytest.raises(RuntimeError, match="some other error"):
            bench_tax_ablation.run("refusing", torch.device("cpu"), 1, 1, bench_tax_ablation.SETTINGS)
    finally:
        torch.use_deterministic_algorithms(before[0])
        patch_refused_ops(before[1])
