"""benchmarks/fit_startup.py on the CPU: the import report's parsing and a real train.py run's marks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import fit_startup  # noqa: E402

IMPORTTIME = """\
import time: self [us] | cumulative | imported package
import time:       100 |        100 | _io
import time:      2000 |    1500000 |   torch
import time:       500 |    2500000 | lightning.pytorch
a warning printed in the middle
import time:       300 |     700000 |     transformers.utils
import time:        50 |     400000 |   torch._dynamo.utils
import time:       400 |     600000 | torch._dynamo
"""


def test_read_importtime_sums_the_top_level_and_bounds_each_watched_module_by_its_heaviest_line():
    report = fit_startup.read_importtime(IMPORTTIME)
    assert report["imports_s"] == 3.1  # the top-level lines (one space after the bar) only, rounded to 1 ms
    assert list(report["heaviest_top_level"]) == ["lightning.pytorch", "torch._dynamo", "_io"]
    # torch._dynamo is its own entry (the longest watched prefix), not torch's; transformers from its submodule
    assert report["watched"] == {"torch": 1.5, "lightning.pytorch": 2.5, "transformers": 0.7, "torch._dynamo": 0.6}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--runs", "0"], "--runs must be >= 1, got 0"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--arg=max_steps=3"], "--arg: expected --KEY=VALUE (a train.py override), got 'max_steps=3'"),
    ],
)
def test_bad_options_are_refused_by_name(tmp_path, options, message, capsys):
    with pytest.raises(SystemExit) as exited:
        fit_startup.main(["--out", str(tmp_path), *options])
    assert exited.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing ran


def test_a_bytecode_cache_is_a_writable_prefix_and_the_repository_leads_the_path(tmp_path, monkeypatch):
    from bench_fit import fit_environment

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = fit_environment(str(tmp_path / "cache"), REPO / "benchmarks")
    assert env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "cache") and "PYTHONDONTWRITEBYTECODE" not in env
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), str(REPO / "benchmarks"), "/elsewhere"]
    plain = fit_environment(None)  # no cache: the caller's bytecode settings stand
    assert "PYTHONPYCACHEPREFIX" not in plain and plain["PYTHONDONTWRITEBYTECODE"] == "1"


@pytest.mark.slow  # one train.py process
def test_a_train_py_run_records_every_mark_in_order_and_its_imports(tmp_path):
    tiny = ["--arg=--model.env.num_envs=4", "--arg=--model.network.hidden_size=8", "--arg=--model.env.rollout_length=4"]
    assert fit_startup.main(["--out", str(tmp_path), "--config", "configs/default.yaml", "--runs", "1",
                             "--steps", "12", *tiny]) == 0  # fmt: skip
    (run,) = json.loads((tmp_path / "fit_startup_default.json").read_text())["runs"]
    assert run["returncode"] == 0
    names = ["cli_parsed", "setup", "train_start", "step_1", "step_10", "step_12", "exited"]
    assert list(run["marks_s"]) == names
    seconds = [run["marks_s"][name] for name in names]
    assert 0 < seconds[0] and seconds == sorted(seconds)
    assert run["ms_per_step"] == pytest.approx((seconds[5] - seconds[4]) * 1000 / 2, abs=1e-3)
    # the report is Python's: lightning.pytorch is imported before the CLI can parse anything
    assert 0 < run["watched"]["lightning.pytorch"] <= run["imports_s"] < seconds[0]
