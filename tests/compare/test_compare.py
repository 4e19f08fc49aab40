"""Tests for ``deepep-compare`` (the package deepep_lightning/compare: verdict, reader, cli).

Runs are written with ``torch.utils.tensorboard.SummaryWriter``, as Lightning's TensorBoardLogger does.
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from deepep_lightning.compare import EventFileError, compare_runs, main

REPO = Path(__file__).resolve().parents[2]
STEPS = range(50)


def _f32(bits: int) -> float:
    """The Python float holding exactly the float32 with these bits."""
    return float(np.array([bits], dtype=np.uint32).view(np.float32)[0])


def _bits(value: float) -> int:
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0])


def _curve(step: int) -> float:
    return float(np.float32(1.0) / np.float32(step + 1))


def write_run(directory, tags=None, **writer_kwargs) -> Path:
    """Write ``{tag: {step: value}}`` (default: 'loss' and 'acc' over 50 steps) and return the directory."""
    if tags is None:
        tags = {"loss": {s: _curve(s) for s in STEPS}, "acc": {s: float(s) for s in STEPS}}
    writer = SummaryWriter(str(directory), **writer_kwargs)
    for tag, points in tags.items():
        for step, value in points.items():
            writer.add_scalar(tag, value, step)
    writer.close()
    return Path(directory)


def _event_file(run: Path) -> Path:
    (path,) = [p for p in run.rglob("*") if "tfevents" in p.name]
    return path


@pytest.fixture
def reference(tmp_path):
    return write_run(tmp_path / "a")


def test_identical_runs_exit_0(reference, tmp_path, capsys):
    other = write_run(tmp_path / "b")
    assert main([str(reference), str(other)]) == 0
    assert "IDENTICAL" in capsys.readouterr().out
    result = compare_runs([reference, other])
    assert result.identical
    assert set(result.comparisons[0].tags) == {"loss", "acc"}
    assert all(t.first_divergent_step is None for t in result.comparisons[0].tags.values())


def test_one_ulp_at_step_37_is_reported(reference, tmp_path, capsys):
    loss = {s: _curve(s) for s in STEPS}
    loss[37] = _f32(_bits(loss[37]) + 1)
    other = write_run(tmp_path / "b", {"loss": loss, "acc": {s: float(s) for s in STEPS}})
    assert main([str(reference), str(other)]) == 1
    out = capsys.readouterr().out
    assert "DIVERGED" in out and "37" in out
    tag = compare_runs([reference, other]).comparisons[0].tags["loss"]
    assert not tag.identical and tag.first_divergent_step == 37 and tag.differing_points == 1
    assert tag.reference_value == _curve(37) and tag.other_value == loss[37]
    assert int(tag.other_bits, 16) - int(tag.reference_bits, 16) == 1
    assert 0 < tag.max_rel_diff < 2**-22  # one float32 ulp, relative
    assert tag.first_step_rel_above_rtol is None  # 1 ulp is below the default rtol ...
    strict = compare_runs([reference, other], rtol=0.0).comparisons[0].tags["loss"]
    assert strict.first_step_rel_above_rtol == 37  # ... and above rtol=0
    assert compare_runs([reference, other]).comparisons[0].tags["acc"].identical


def test_different_step_sets(reference, tmp_path):
    loss = {s: _curve(s) for s in STEPS if s != 10}
    acc = {s: float(s) for s in range(60)}  # logs ten more steps
    result = compare_runs([reference, write_run(tmp_path / "b", {"loss": loss, "acc": acc})])
    assert not result.identical
    missing, extra = result.comparisons[0].tags["loss"], result.comparisons[0].tags["acc"]
    assert missing.first_divergent_step == 10 and missing.other_value is None
    assert missing.reference_value == _curve(10) and missing.differing_points == 0  # common steps agree
    assert (missing.steps_reference, missing.steps_other, missing.common_steps) == (50, 49, 49)
    assert extra.first_divergent_step == 50 and extra.reference_value is None and extra.other_value == 50.0


def test_missing_tags_are_listed_and_diverge(reference, tmp_path, capsys):
    other = write_run(tmp_path / "b", {"loss": {s: _curve(s) for s in STEPS}, "lr": {0: 0.1}})
    result = compare_runs([reference, other])
    pair = result.comparisons[0]
    assert pair.only_in_reference == ["acc"] and pair.only_in_other == ["lr"]
    assert pair.tags["loss"].identical and not result.identical
    assert main([str(reference), str(other)]) == 1
    assert "tags only in the reference: acc" in capsys.readouterr().out
    assert main([str(reference), str(other), "--tag", "loss"]) == 0  # restricted to the common tag


def test_no_common_tag_is_an_error(reference, tmp_path, capsys):
    other = write_run(tmp_path / "b", {"reward": {0: 1.0}})
    assert main([str(reference), str(other)]) == 2
    assert "share no scalar tag" in capsys.readouterr().err


def test_signed_zero_and_nan_are_compared_by_bits(tmp_path):
    quiet_nan, other_nan = _f32(0x7FC00001), _f32(0x7FC00002)
    a = write_run(tmp_path / "a", {"zero": {0: 0.0}, "nan": {0: quiet_nan}, "same_nan": {0: quiet_nan}})
    b = write_run(tmp_path / "b", {"zero": {0: -0.0}, "nan": {0: other_nan}, "same_nan": {0: quiet_nan}})
    tags = compare_runs([a, b]).comparisons[0].tags
    assert tags["same_nan"].identical  # NaN == NaN when the bits agree
    assert not tags["zero"].identical and tags["zero"].max_abs_diff == 0.0
    assert (tags["nan"].reference_bits, tags["nan"].other_bits) == ("0x7fc00001", "0x7fc00002")
    assert tags["nan"].max_abs_diff == float("inf")


@pytest.mark.parametrize(
    "damage, message",
    [("empty", "is empty (0 bytes)"), ("truncate", "truncated record"), ("flip", "crc32 check")],
)
def test_damaged_event_file_exit_2(reference, tmp_path, capsys, damage, message):
    other = shutil.copytree(reference, tmp_path / "b")
    path = _event_file(other)
    data = bytearray(path.read_bytes())
    if damage == "empty":
        data = bytearray()
    elif damage == "truncate":
        data = data[:-7]  # a writer killed mid-record
    else:
        data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert main([str(reference), str(other)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err
    with pytest.raises(EventFileError):
        compare_runs([reference, other])


def test_event_accumulator_alone_would_hide_truncation(reference, tmp_path):
    """Negative control: tensorboard's reader drops the damaged tail silently, which is why we scan first."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea

    path = _event_file(shutil.copytree(reference, tmp_path / "b"))
    path.write_bytes(path.read_bytes()[:-7])
    accumulator = pea.EventAccumulator(str(path), size_guidance={pea.TENSORS: 0})
    accumulator.Reload()  # no exception
    assert len(accumulator.Tensors("acc")) + len(accumulator.Tensors("loss")) == 2 * len(STEPS) - 1


def test_run_without_scalars_or_event_files_exit_2(reference, tmp_path, capsys):
    SummaryWriter(str(tmp_path / "header_only")).close()  # a file with only the version record
    (tmp_path / "no_events").mkdir()
    assert main([str(reference), str(tmp_path / "header_only")]) == 2
    assert "holds no scalar data" in capsys.readouterr().err
    assert main([str(reference), str(tmp_path / "no_events")]) == 2
    assert "holds no TensorBoard event file" in capsys.readouterr().err
    assert main([str(reference), str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_lightning_layout_resolution(reference, tmp_path, capsys):
    save_dir = tmp_path / "logs"
    write_run(save_dir / "lightning_logs" / "version_0")
    assert compare_runs([reference, save_dir]).identical  # descends into the one version_N
    assert compare_runs([reference, save_dir / "lightning_logs" / "version_0"]).identical
    assert compare_runs([_event_file(reference), save_dir]).identical  # an event file as the run
    write_run(save_dir / "lightning_logs" / "version_1")
    assert main([str(reference), str(save_dir)]) == 2
    err = capsys.readouterr().err
    assert "several Lightning versions" in err and "version_1" in err


def test_several_files_merge_and_subdirectories_prefix(tmp_path):
    run = tmp_path / "resumed"
    write_run(run, {"loss": {s: _curve(s) for s in range(30)}})
    write_run(
        run, {"loss": {s: _curve(s) for s in range(20, 50)}, "acc": {s: float(s) for s in STEPS}}, filename_suffix=".z"
    )  # a resumed writer: steps 20-29 again, sorts after the first file
    writer = SummaryWriter(str(tmp_path / "nested"))
    writer.add_scalars("grp", {"x": 1.0}, 0)  # writes to the sub-directory grp_x
    writer.close()
    result = compare_runs([write_run(tmp_path / "a"), run])
    assert result.identical and result.runs[1].overwritten_points == 10
    assert len(result.runs[1].event_files) == 2
    nested = compare_runs([tmp_path / "nested", tmp_path / "nested"])
    assert list(nested.comparisons[0].tags) == ["grp_x/grp"]


def test_more_than_two_runs_each_against_the_first(reference, tmp_path):
    same = write_run(tmp_path / "same")
    loss = {s: _curve(s) + (1.0 if s >= 5 else 0.0) for s in STEPS}
    different = write_run(tmp_path / "diff", {"loss": loss, "acc": {s: float(s) for s in STEPS}})
    result = compare_runs([reference, same, different])
    assert [p.identical for p in result.comparisons] == [True, False]
    assert result.comparisons[1].tags["loss"].first_divergent_step == 5
    assert main([str(reference), str(same), str(different)]) == 1
    assert main([str(reference), str(same)]) == 0


def test_json_plot_and_layout_outputs(reference, tmp_path, capsys):
    other = write_run(tmp_path / "b", {"loss": {s: _curve(s) * 2 for s in STEPS}, "acc": {0: float("nan")}})
    json_path, png, layout = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "layout"
    outputs = ["--json", str(json_path), "--plot", str(png), "--tb-layout", str(layout)]
    assert main([str(reference), str(other)] + outputs) == 1
    report = json.loads(json_path.read_text())  # strict JSON: non-finite floats became strings
    assert report["identical"] is False and len(report["runs"]) == 2
    loss = report["comparisons"][0]["tags"]["loss"]
    assert loss["first_divergent_step"] == 0 and loss["first_step_rel_above_rtol"] == 0
    assert report["comparisons"][0]["tags"]["acc"]["max_abs_diff"] == "inf"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(str(png))
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea

    accumulator = pea.EventAccumulator(str(_event_file(layout)))
    accumulator.Reload()
    assert "custom_scalars" in accumulator.ActivePlugins()
    capsys.readouterr()
    assert main([str(reference), str(reference), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["identical"] is True


def test_argument_validation(reference):
    with pytest.raises(ValueError, match="at least two runs"):
        compare_runs([reference])
    with pytest.raises(ValueError, match="`rtol` must be a finite number >= 0, got -1"):
        compare_runs([reference, reference], rtol=-1)
    with pytest.raises(ValueError, match=r"`tags` \['los'\] were logged by no run"):
        compare_runs([reference, reference], tags=["los"])
    with pytest.raises(TypeError, match="HINT"):
        compare_runs([reference, reference], tags="loss")
    assert main([str(reference)]) == 2
    assert main([str(reference), str(reference), "--tag", "los"]) == 2
    with pytest.raises(SystemExit):
        main([str(reference), str(reference), "--rtol", "nan"])


def test_help_says_how_runs_are_picked(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "version_N" in help_text and "Exit codes" in help_text and "--rtol" in help_text


def _lightning_run(quiet_trainer, module_class, save_dir: Path, seed: int) -> Path:
    """A tiny seeded Lightning fit logging through TensorBoardLogger into save_dir/lightning_logs/version_0."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    pl.seed_everything(seed, verbose=False)  # the initial weights
    trainer = quiet_trainer(
        max_steps=8,
        log_every_n_steps=1,
        limit_val_batches=0,
        logger=TensorBoardLogger(str(save_dir)),
    )
    trainer.fit(module_class())
    return save_dir


def test_lightning_tensorboard_logger_runs(tmp_path, boring_module, quiet_trainer):
    first = _lightning_run(quiet_trainer, boring_module, tmp_path / "s1", seed=3)
    second = _lightning_run(quiet_trainer, boring_module, tmp_path / "s2", seed=3)
    assert (first / "lightning_logs" / "version_0").is_dir()
    result = compare_runs([first, second])
    assert result.identical and "train/loss" in result.comparisons[0].tags
    assert result.comparisons[0].tags["train/loss"].steps_reference == 8
    other_seed = _lightning_run(quiet_trainer, boring_module, tmp_path / "s3", seed=4)  # negative control
    assert main([str(first), str(other_seed)]) == 1


@pytest.mark.slow
def test_two_seeded_train_py_runs_are_identical(tmp_path, fit_process, run_process):
    """End to end: two short ``train.py`` runs with one seed, in separate processes, compare identical.

    The comparison runs as its own process too, as the ``deepep-compare`` script does (``sys.exit(main())``).
    """
    if not (REPO / "train.py").is_file() or not (REPO / "configs" / "default.yaml").is_file():
        pytest.skip("train.py or configs/default.yaml is missing")
    steps = 6

    def train(save_dir):
        args = [
            "fit",
            "--config",
            "configs/default.yaml",
            "--seed_everything=5",
            f"--trainer.max_steps={steps}",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_checkpointing=false",
            f"--trainer.logger.init_args.save_dir={save_dir}",
            "--model.execution.fused_value_head=false",  # the pure-PyTorch value head
        ]
        return fit_process(REPO / "train.py", args, log_path=tmp_path / f"{save_dir.name}.log")

    runs = [train(tmp_path / "a"), train(tmp_path / "b")]  # side by side: most of the time is the import
    for process in runs:
        assert process.wait() == 0, process.output_tail(3000)
    compare = run_process(
        [sys.executable, "-m", "deepep_lightning.compare", str(tmp_path / "a"), str(tmp_path / "b"), "--json", "-"],
        cwd=REPO,
    )
    out = compare.stdout
    assert compare.returncode == 0, out[-3000:] + compare.stderr[-3000:]
    report = json.loads(out)
    assert report["identical"] is True
    loss = report["comparisons"][0]["tags"]["train/loss"]  # the curves were really there
    assert loss["steps_reference"] == steps and loss["common_steps"] == steps


def test_the_tools_own_output_errors_exit_2_not_diverged(reference, tmp_path, capsys, monkeypatch):
    """1 means the runs diverged; an unwritable --json path or a failing plot is the tool's error (2)."""
    from deepep_lightning.compare import cli

    blocked = tmp_path / "file"
    blocked.write_text("x")
    assert main([str(reference), str(reference), "--json", str(blocked / "out.json")]) == 2
    assert "deepep-compare: error" in capsys.readouterr().err

    def broken_plot(result, path):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(cli, "plot_comparison", broken_plot)
    assert main([str(reference), str(reference), "--plot", str(tmp_path / "p.png")]) == 2
    assert "ImportError" in capsys.readouterr().err
    assert main([str(reference), str(reference)]) == 0  # negative control: the same runs, no output, exit 0


def _bookkeeping_run(directory, step_rate):
    """'loss' equal in every run; Lightning's hp_metric and epoch; a wall-clock perf/ figure that differs."""
    tags = {
        "loss": {s: _curve(s) for s in STEPS},
        "hp_metric": {0: -1.0},
        "epoch": {s: float(s // 10) for s in STEPS},
        "perf/env_steps_per_s": {s: step_rate + s for s in STEPS},
    }
    return write_run(directory, tags)


def test_hp_metric_epoch_and_perf_tags_are_left_out_unless_asked_for(tmp_path, capsys):
    a, b = _bookkeeping_run(tmp_path / "a", 1000.0), _bookkeeping_run(tmp_path / "b", 1234.5)
    result = compare_runs([a, b])
    assert result.identical and result.compared_tags == {"loss"}
    assert result.excluded == ["epoch", "hp_metric", "perf/env_steps_per_s"]
    assert main([str(a), str(b)]) == 0
    assert "not compared (see --all-tags): epoch, hp_metric, perf/env_steps_per_s" in capsys.readouterr().out
    # negative controls: every tag compared, or the perf tag named, and the wall-clock figure differs
    assert main([str(a), str(b), "--all-tags"]) == 1
    assert not compare_runs([a, b], tags=["perf/env_steps_per_s"]).identical
    assert compare_runs([a, b], exclude=["loss"]).compared_tags == {"hp_metric", "epoch", "perf/env_steps_per_s"}
    assert main([str(a), str(b), "--exclude", "loss", "--json", "-"]) == 2  # nothing left in common: an error
    with pytest.raises(TypeError, match="exclude"):
        compare_runs([a, b], exclude="perf/*")


def test_png_title_is_the_verdict_and_bookkeeping_tags_get_no_row(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from deepep_lightning.compare.plot import plot_comparison, verdict_title

    drawn = {}

    def record(figure, path, **kwargs):
        drawn["title"] = figure._suptitle.get_text()
        drawn["rows"] = [axis.get_title() for axis in figure.axes[::2]]

    monkeypatch.setattr(Figure, "savefig", record)
    a, b = _bookkeeping_run(tmp_path / "a", 1000.0), _bookkeeping_run(tmp_path / "b", 1.0)
    plot_comparison(compare_runs([a, b]), str(tmp_path / "same.png"))
    assert drawn == {"title": "IDENTICAL: 1 tags bitwise equal in 2 runs", "rows": ["loss"]}
    other = write_run(tmp_path / "c", {"loss": {s: _curve(s) + (1.0 if s >= 37 else 0.0) for s in STEPS}})
    diverged = compare_runs([a, other])
    plot_comparison(diverged, str(tmp_path / "diverged.png"))
    assert drawn["title"] == verdict_title(diverged) == "DIVERGED: 1 of 1 tags differ, first at step 37"
