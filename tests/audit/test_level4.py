"""L4: two fresh training processes, optionally killed and resumed (deepep_lightning/audit/level4.py)."""

import os
from pathlib import Path

import pytest
import torch
from torch.utils.tensorboard import SummaryWriter

from deepep_lightning.audit.level4 import _compare, audit_training, compare_states


def _fake_run(root, name, weight, losses):
    os.makedirs(os.path.join(root, name, "tb"))
    torch.save(
        {"state_dict": {"w": weight}, "optimizers": [], "global_step": len(losses)},
        os.path.join(root, name, "final.pt"),
    )
    writer = SummaryWriter(os.path.join(root, name, "tb"))
    for step, loss in enumerate(losses):
        writer.add_scalar("train/loss", loss, step)
    writer.close()


@pytest.mark.parametrize("plant", [None, "state", "scalar"])
def test_compare_flags_a_planted_difference(tmp_path, plant):
    weight = torch.randn(5)
    other = weight.clone()
    if plant == "state":
        other[2] = torch.nextafter(other[2], torch.tensor(10.0))
    losses = [0.5, 0.25, 0.125]
    _fake_run(str(tmp_path), "a", weight, losses)
    _fake_run(str(tmp_path), "b", other, losses[:2] + [0.126] if plant == "scalar" else losses)
    result = _compare(str(tmp_path), "fake", [])
    assert result.status == ("reproducible" if plant is None else "divergent"), result.describe()
    if plant == "state":
        assert result.differing == ["state_dict.w"]
    if plant == "scalar":
        assert result.differing == ["scalar:train/loss"]


def test_compare_states_reports_missing_and_different():
    diff = compare_states({"a": torch.ones(2), "b": torch.zeros(1)}, {"a": torch.ones(2) * 2, "c": torch.zeros(1)})
    assert diff == {"a": 1.0, "b": None, "c": None}


def test_bad_resume_step_raises():
    with pytest.raises(ValueError, match="resume_at"):
        audit_training(steps=3, resume_at=3)


@pytest.mark.slow
def test_deepep_kill_and_resume_from_the_cli(tmp_path, capsys):
    # Run b is SIGKILLed after step 2 (mid-epoch) and resumed in a third process. Measured: without
    # --determinism the epoch-level train/episode_return differs after the resume (steps_per_epoch=3),
    # with it everything is bitwise equal. The planted-difference tests above are the negative controls.
    from deepep_lightning.audit.cli import main

    code = main(
        [
            "l4",
            "--config",
            "configs/default.yaml",
            "--steps",
            "3",
            "--resume-at",
            "2",
            "--determinism",
            "--workdir",
            str(tmp_path),
            "--model.execution.fused_value_head=false",
            "--model.env.num_envs=4",
            "--model.env.rollout_length=4",
            "--model.network.hidden_size=8",
            "--model.env.steps_per_epoch=3",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "train/loss" in out and "DIFFERS" not in out
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "b" / "ckpt" / "last.ckpt").exists()


@pytest.mark.slow
def test_l4_fits_with_a_data_module_from_the_flag_or_the_config(tmp_path, monkeypatch):
    """A module without loaders trains in both fresh processes on the DataModule's batches."""
    import yaml

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the subprocesses import _planted
    result = audit_training(
        "_planted:ModuleWithoutData", steps=2, data="_planted:PlantedData", workdir=str(tmp_path / "f")
    )
    assert result.status == "reproducible", result.error
    config = tmp_path / "cli.yaml"
    config.write_text(yaml.safe_dump({"data": {"class_path": "_planted.PlantedData", "init_args": {"batch_size": 4}}}))
    result = audit_training("_planted:ModuleWithoutData", str(config), steps=2, workdir=str(tmp_path / "c"))
    assert result.status == "reproducible", result.error
    # negative control: without a DataModule the runs cannot start
    assert audit_training("_planted:ModuleWithoutData", steps=2, workdir=str(tmp_path / "n")).status == "error"
