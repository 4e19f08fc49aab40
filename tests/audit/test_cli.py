"""``deepep-audit`` (deepep_lightning/audit/cli.py): help, exit codes, JSON."""

import json
import re

import pytest

from deepep_lightning.audit.cli import main


def test_help_documents_levels_protocol_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for needle in (
        "l1",
        "l2",
        "l3",
        "l4",
        "CUDA_LAUNCH_BLOCKING",
        "first divergent op",
        "package.module:Class",
        "Exit code: 0 reproducible, 1 divergence found, 2 could not run",
    ):
        assert needle in text


def test_clean_module_exits_0(capsys):
    assert main(["l2", "--target", "_planted:CleanModule", "--device", "cpu", "--repeats", "3"]) == 0
    assert "REPRODUCIBLE" in capsys.readouterr().out


def test_planted_fault_exits_1_and_json_names_the_op_and_module(capsys, tmp_path):
    out = tmp_path / "report.json"
    code = main(
        [
            "l3",
            "--target",
            "_planted:UnseededRNGModule",
            "--device",
            "cpu",
            "--repeats",
            "3",
            "--steps",
            "2",
            "--json",
            str(out),
        ]
    )
    assert code == 1
    assert "DIVERGENT" in capsys.readouterr().out  # --json PATH: the file, and the text report on stdout
    printed = json.loads(out.read_text())
    divergence = printed["results"][0]["divergence"]
    assert "randn" in divergence["op"] and divergence["module_path"].endswith("encoder.gate")
    assert printed["exit_code"] == 1 and printed["environment"]["torch"]


def test_cannot_run_exits_2(capsys):
    assert main(["l2", "--target", "no_such_package_xyz:Model", "--device", "cpu"]) == 2
    assert "cannot import" in capsys.readouterr().err
    assert main(["l2", "--target", "_planted:CleanModule", "--config", "/nonexistent.yaml"]) == 2


def test_l1_catalogue_subset_and_list(capsys, tmp_path):
    table = tmp_path / "table.md"
    assert (
        main(
            [
                "l1",
                "--ops",
                "cumsum,index_add_",
                "--columns",
                "default",
                "--device",
                "cpu",
                "--repeats",
                "3",
                "--table-out",
                str(table),
            ]
        )
        == 0
    )
    assert re.search(r"\| cumsum \| yes \S+ ms \| prefix sum", capsys.readouterr().out)
    assert re.search(r"\| index_add_ \| yes \S+ ms \| duplicate indices", table.read_text())
    assert main(["l1", "--list"]) == 0
    assert "grid_sample_backward" in capsys.readouterr().out


def test_l1_extend_imports_the_module_that_adds_rows(capsys):
    assert main(["l1", "--list", "--extend", "deepep_lightning.deepep.kernels"]) == 0
    assert "all_action_q_atomic" in capsys.readouterr().out
    assert main(["l1", "--list", "--extend", "no_such_package_xyz"]) == 2
    assert "--extend 'no_such_package_xyz': cannot import it" in capsys.readouterr().err


def test_l1_callable_planted(capsys):
    assert main(["l1", "--callable", "_planted:counting_callable", "--repeats", "4"]) == 1
    out = capsys.readouterr().out
    assert "DIVERGENT" in out and "first divergent op: aten.mul.Tensor" in out and "Python state" in out


def test_unknown_argument_outside_l4_is_rejected():
    with pytest.raises(SystemExit) as done:
        main(["l2", "--model.hidden=3"])
    assert done.value.code == 2


@pytest.mark.parametrize("flag", ["--variant", "--value-head"])
def test_variant_flag_and_its_value_head_alias(capsys, flag):
    args = ["l3", "--target", "_planted:SequenceModule", "--device", "cpu", "--repeats", "3"]
    assert main([*args, flag, "clean"]) == 0
    assert "variant=clean" in capsys.readouterr().out
    assert main([*args, flag, "unseeded"]) == 1  # negative control: the planted variant diverges
    assert main([*args, flag, "no_such_variant"]) == 2
    assert "'clean', 'unseeded'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["l2", "--target", "collections:OrderedDict", "--device", "cpu"], "is not a LightningModule"),
        (["l4", "--target", "collections:OrderedDict", "--steps", "2"], "is not a LightningModule"),
        (["l2", "--target", "_planted:CleanModule", "--device", "tpu"], "`device` must be 'cpu', 'cuda' or 'cuda:N'"),
        (["l1", "--device", "tpu"], "got 'tpu'"),
    ],
)
def test_own_errors_exit_2_with_a_clear_message(capsys, argv, message):
    """The tool's own errors are "could not run" (2), never "divergent" (1)."""
    assert main(argv) == 2
    assert message in capsys.readouterr().err
