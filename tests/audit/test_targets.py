"""audit/targets.py: where L2/L3 take their batches from, a module's loader or a LightningDataModule."""

import json

import pytest
import yaml

from deepep_lightning.audit.cli import main
from deepep_lightning.audit.targets import ModuleTarget, load_data


def _cli_yaml(tmp_path, data):
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump({"model": {"hidden": 8}, "data": data}))
    return str(path)


def _first_batch_size(target):
    return target.prepare("L2").batches[0][0].shape[0]


def test_data_module_named_by_flag_gives_the_batches(capsys):
    args = ["l2", "--target", "_planted:ModuleWithoutData", "--device", "cpu", "--repeats", "3"]
    assert main(args) == 2  # negative control: the module has no loader of its own
    shown = capsys.readouterr()
    assert "no train_dataloader() of its own" in shown.out + shown.err and "HINT: --data" in shown.out + shown.err
    assert main([*args, "--data", "_planted:PlantedData"]) == 0
    assert "REPRODUCIBLE" in capsys.readouterr().out


def test_config_data_section_class_path_and_init_args(tmp_path, capsys):
    config = _cli_yaml(tmp_path, {"class_path": "_planted.PlantedData", "init_args": {"batch_size": 4}})
    target = ModuleTarget("_planted:ModuleWithoutData", config, device="cpu")
    assert target.config == {"hidden": 8} and _first_batch_size(target) == 4
    args = ["l3", "--target", "_planted:ModuleWithoutData", "--config", config, "--device", "cpu", "--repeats", "2"]
    assert main(args) == 0, capsys.readouterr().err


def test_flag_names_the_class_and_the_config_gives_its_init_args(tmp_path):
    config = _cli_yaml(tmp_path, {"batch_size": 2})  # a data: section of init args only
    target = ModuleTarget("_planted:ModuleWithoutData", config, device="cpu", data="_planted:PlantedData")
    assert _first_batch_size(target) == 2
    with pytest.raises(ValueError, match=r"no class_path.*HINT: --data"):
        ModuleTarget("_planted:ModuleWithoutData", config, device="cpu")


def test_a_data_module_replaces_the_module_loader_as_trainer_fit_does():
    target = ModuleTarget("_planted:CleanModule", device="cpu", data="_planted:PlantedData")
    assert _first_batch_size(target) == 8
    assert load_data(None, None) is None and ModuleTarget("_planted:CleanModule", device="cpu").data is None


def test_a_data_spec_that_is_no_data_module_is_refused(capsys):
    args = ["l2", "--target", "_planted:CleanModule", "--device", "cpu", "--data", "_planted:CleanModule"]
    assert main(args) == 2
    assert "is not a LightningDataModule" in capsys.readouterr().err


def test_json_convention_path_or_stdout(tmp_path, capsys):
    args = ["l2", "--target", "_planted:CleanModule", "--device", "cpu", "--repeats", "2"]
    report = tmp_path / "report.json"
    assert main([*args, "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "REPRODUCIBLE" in out and json.loads(report.read_text())["exit_code"] == 0  # file + the text report
    assert main([*args, "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["exit_code"] == 0  # stdout holds the JSON only
    assert main([*args, "--json", str(tmp_path / "no" / "such" / "dir.json")]) == 2
    assert "--json" in capsys.readouterr().err


def test_l1_table_has_a_legend(capsys):
    args = ["l1", "--ops", "cumsum", "--columns", "default,deterministic", "--device", "cpu", "--repeats", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Legend: yes = 3 calls gave bitwise identical outputs" in out and "raises = " in out
    assert "deterministic = torch.use_deterministic_algorithms(True)" in out and "launch_blocking =" not in out
