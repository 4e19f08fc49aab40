"""DeepEPModule's typed configuration: groups that check their fields, LightningCLI keys, checkpoints."""

import runpy
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.deepep import (
    DeepEPConfig,
    DeepEPModule,
    EnvConfig,
    ExecutionConfig,
    LossConfig,
    NetworkConfig,
    OptimConfig,
    grouped,
)

ROOT = Path(__file__).resolve().parents[2]
SIZES = dict(num_envs=4, rollout_length=4, hidden_size=8, steps_per_epoch=3)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: EnvConfig(num_envs=0), r"`EnvConfig\(num_envs=...\)` must be a positive int, got 0"),
        (lambda: NetworkConfig(chrono_horizon=1), r"`NetworkConfig\(chrono_horizon=...\)` must be .*>= 2, got 1"),
        (lambda: LossConfig(gamma=1.5), r"`LossConfig\(gamma=...\)` must be a number in \[0.0, 1.0\], got 1.5"),
        (lambda: OptimConfig(optimizer="lamb"), r"`OptimConfig\(optimizer=...\)` must be 'adam' or 'sgd', got 'lamb'"),
        (lambda: ExecutionConfig(cuda_graph="yes"), r"`ExecutionConfig\(cuda_graph=...\)` must be a bool, got 'yes'"),
        (lambda: DeepEPConfig(seed=1.5), r"`DeepEPModule\(seed=...\)` must be an int, got 1.5"),
        (lambda: DeepEPConfig(env=[1]), r"`DeepEPModule\(env=...\)` must be of type EnvConfig or a dict of its fields"),
    ],
)
def test_each_group_refuses_a_bad_field_naming_the_group_the_field_and_the_value(build, message):
    with pytest.raises(MisconfigurationException, match=message):
        build()


def test_checks_that_span_groups_run_when_the_whole_configuration_is_built():
    OptimConfig(optimizer="sgd")  # each group alone is valid
    ExecutionConfig(cuda_graph=True)
    with pytest.raises(MisconfigurationException, match=r"optimizer='sgd'.*cuda_graph=True.*HINT"):
        DeepEPConfig(optim=OptimConfig(optimizer="sgd"), execution=ExecutionConfig(cuda_graph=True))
    with pytest.raises(ValueError, match=r"fused_bptt=...\)` must be None or False with detach_feedback=False"):
        DeepEPConfig(network=NetworkConfig(detach_feedback=False), execution=ExecutionConfig(fused_bptt=True))
    with pytest.raises(MisconfigurationException, match=r"target_entropy=.*\[0.0, 0.693147\]"):  # log 2: CartPole
        DeepEPConfig(loss=LossConfig(target_entropy=0.9))


def test_grouped_routes_each_field_to_its_group_and_refuses_an_unknown_name():
    arguments = grouped(num_envs=8, hidden_size=16, gamma=0.9, learning_rate=1e-3, cuda_graph=False, seed=3)
    assert arguments == {
        "env": EnvConfig(num_envs=8),
        "network": NetworkConfig(hidden_size=16),
        "loss": LossConfig(gamma=0.9),
        "optim": OptimConfig(learning_rate=1e-3),
        "execution": ExecutionConfig(cuda_graph=False),
        "seed": 3,
    }
    with pytest.raises(TypeError, match=r"grouped\(\) got 'num_env'.*env: \[.*'num_envs'"):
        grouped(num_env=8)


def test_hyperparameters_are_plain_dicts_and_a_checkpoint_loads_back_into_the_same_configuration(tmp_path):
    model = DeepEPModule(**grouped(**SIZES, learning_rate=1e-3, fused_value_head=False, seed=5))
    assert model.hparams["env"]["num_envs"] == 4 and model.hparams["optim"]["learning_rate"] == 1e-3
    assert all(isinstance(value, (dict, int, bool)) for value in model.hparams.values())
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model)
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    # the safe loader: hyperparameters of builtin types only, no pickled classes
    assert torch.load(path, weights_only=True)["hyper_parameters"]["env"]["num_envs"] == 4
    loaded = DeepEPModule.load_from_checkpoint(path)
    assert loaded.config == model.config
    assert all(torch.equal(value, model.state_dict()[key]) for key, value in loaded.state_dict().items())


def test_lightning_cli_shows_and_validates_the_fields_under_their_group(tmp_path, capsys):
    main = runpy.run_path(str(ROOT / "train.py"), run_name="train_module")["main"]
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(ROOT / "configs" / "default.yaml"), "--print_config"])
    printed = capsys.readouterr().out
    assert "  optim:\n" in printed and "    learning_rate: 0.003\n" in printed and "    num_envs: 32\n" in printed
    with pytest.raises(MisconfigurationException, match=r"`OptimConfig\(learning_rate=...\)` must be .*got 0"):
        main(["fit", "--config", str(ROOT / "configs" / "default.yaml"), "--model.optim.learning_rate=0",
              f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
