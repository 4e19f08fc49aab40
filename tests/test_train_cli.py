"""train.py (LightningCLI): bad configuration is refused before any training starts."""

import runpy
from pathlib import Path

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = str(ROOT / "configs" / "default.yaml")


def _main(args):
    namespace = runpy.run_path(str(ROOT / "train.py"), run_name="train_module")
    return namespace["main"](args)


def test_unknown_config_key_names_the_key(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _main(["fit", "--config", DEFAULT, "--model.env.num_envz=4"])
    assert exit_info.value.code != 0
    assert "num_envz" in capsys.readouterr().err


def test_bad_value_names_argument_and_value_before_training(tmp_path):
    with pytest.raises(MisconfigurationException, match=r"num_envs=.*must be a positive int, got 0"):
        _main(["fit", "--config", DEFAULT, "--model.env.num_envs=0", f"--trainer.default_root_dir={tmp_path}"])


def test_unknown_env_name_is_refused(tmp_path):
    with pytest.raises(MisconfigurationException, match=r"name=.*got 'pong'"):
        _main(["fit", "--config", DEFAULT, "--model.env.name=pong", f"--trainer.default_root_dir={tmp_path}"])


@pytest.mark.parametrize("name", ["default", "gpu", "memory", "nan_demo", "ddp", "audit"])
def test_every_config_parses(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _main(["fit", "--config", str(ROOT / "configs" / f"{name}.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    assert "model:" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--optimizer=AdamW", "--optimizer", "--optimizer.lr=0.1", "--lr_scheduler=StepLR"])
def test_lightning_cli_optimizer_flags_are_refused_with_the_reason(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _main(["fit", "--config", DEFAULT, flag])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert repr(flag) in err and "two learning rates" in err and "HINT: --model.optim.learning_rate" in err


def test_no_optimizer_option_in_the_parser(capsys):
    """auto_configure_optimizers=False: LightningCLI offers no --optimizer (negative control: --model.* is there)."""
    with pytest.raises(SystemExit):
        _main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "--model.optim.learning_rate" in out and "--optimizer " not in out and "--lr_scheduler " not in out


def test_configs_show_progress_summary_lr_and_no_hp_metric():
    import yaml

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        trainer = yaml.safe_load(path.read_text())["trainer"]
        assert trainer["enable_progress_bar"] is True, path.name
        callbacks = [entry["class_path"] for entry in trainer["callbacks"]]
        assert "deepep_lightning.RunSummaryCallback" in callbacks, path.name
        if "logger" in trainer:
            assert trainer["logger"]["init_args"]["default_hp_metric"] is False, path.name
            assert "lightning.pytorch.callbacks.LearningRateMonitor" in callbacks, path.name
