"""benchmarks/bench_fit.py on the CPU: train.py processes, their TensorBoard curves, and the bitwise comparison."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_fit  # noqa: E402


def test_read_curve_returns_every_logged_point_of_the_tag_in_step_order(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path, name="fit", version=0)
    for step in (29, 9, 19):  # out of order on purpose
        logger.log_metrics({bench_fit.TAG: step / 2, "train/loss": -1.0}, step=step)
    logger.finalize("success")
    curve = bench_fit.read_curve(tmp_path)
    assert [(step, value) for step, _, value in curve] == [(9, 4.5), (19, 9.5), (29, 14.5)]
    assert all(wall > 0 for _, wall, _ in curve)
    assert bench_fit.read_curve(tmp_path, "train/missing") == []


def test_same_bits_is_exact_and_treats_nan_as_equal():
    curve = [[9, 1.0, float("nan")], [19, 2.0, 21.5]]
    assert bench_fit.same_bits(curve, [[9, 5.0, float("nan")], [19, 6.0, 21.5]])  # wall times do not count
    one_ulp = float(np.nextafter(np.float32(21.5), np.float32(22.0)))
    assert not bench_fit.same_bits(curve, [[9, 1.0, float("nan")], [19, 2.0, one_ulp]])
    assert not bench_fit.same_bits(curve, [[9, 1.0, float("nan")], [29, 2.0, 21.5]])
    assert not bench_fit.same_bits(curve, curve[:1])


def _bench(out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "benchmarks/bench_fit.py", "--out", str(out), "--config", "configs/default.yaml", *extra]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--arg=gamma=0.9"], "--arg: expected --KEY=VALUE (a train.py override), got 'gamma=0.9'"),
        (["--parallel", "0"], "--parallel must be >= 1, got 0"),
        (["--seeds", "0", "--alone", "2"], "--alone must be between 0 and the number of seeds (1), got 2"),
    ],
)
def test_bad_options_are_refused_by_name(tmp_path, options, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_fit.py", "--out", str(tmp_path), *options])
    with pytest.raises(SystemExit) as exited:
        bench_fit.main()
    assert exited.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing ran


@pytest.mark.slow  # three train.py processes
def test_train_py_runs_give_the_logged_curve_and_an_alone_run_repeats_its_parallel_run_bitwise(tmp_path):
    tiny = ["--arg=--trainer.max_steps=30", "--arg=--model.env.num_envs=8", "--arg=--model.network.hidden_size=16",
            "--arg=--model.env.eval_envs=4", "--arg=--model.env.eval_every_n_steps=10"]  # fmt: skip
    done = _bench(tmp_path, "--seeds", "0", "1", "--parallel", "2", "--alone", "1", "--threshold", "15", *tiny)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "fit_default.json").read_text())
    runs = {run["seed"]: run for run in result["runs"]}
    (alone,) = result["alone"]
    assert all(run["returncode"] == 0 for run in [alone, *runs.values()])
    # log_every_n_steps=10 over 30 steps: three points per run, the seconds counted from each launch
    assert [point[0] for point in runs[0]["checkpoints"]] == [9, 19, 29]
    assert all(0 < point[1] < run["wall_s"] for run in runs.values() for point in run["checkpoints"])
    assert alone["same_bits_as_parallel"] and result["summary"]["alone_same_bits"] == [True]
    # the greedy evaluation at every logged step, its figures beside the rolling return's
    assert all([point[0] for point in run["greedy"]["checkpoints"]] == [9, 19, 29] for run in [alone, *runs.values()])
    assert bench_fit.same_bits(alone["greedy"]["checkpoints"], runs[0]["greedy"]["checkpoints"])
    assert result["summary"]["greedy"]["seeds"] == 2
    # negative control: another seed's curve is not the same bits
    assert not bench_fit.same_bits(runs[0]["checkpoints"], runs[1]["checkpoints"])
    for run in runs.values():  # the figures are those of the logged curve
        values = [point[2] for point in run["checkpoints"]]
        assert run["final"] == values[-1]
        if run["reached"]:
            first = next(i for i, value in enumerate(values) if value >= 15)
            assert run["first_step"] == run["checkpoints"][first][0]
            assert math.isclose(run["min_after_first"], min(values[first:]))
