"""End-to-end reproducibility of ``DeterminismCallback`` with real processes (L4 of the pyramid).

Every run is a fresh ``python _run_fit.py`` process. Scenarios, all compared bitwise (model and
optimizer tensors with ``torch.equal``, every TensorBoard scalar by value):

* two uninterrupted runs are equal;
* a run SIGKILLed mid-epoch two steps after its last checkpoint, then resumed in a new process,
  equals the uninterrupted run (plain module with a shuffled DataLoader, 2 workers and random
  augmentation in ``__getitem__``; and DeepEP);
* the same with ``reseed_every_step=False``, where only the checkpointed RNG state carries the
  streams across the restart;
* a checkpoint taken after an epoch's last batch, killed early in the next epoch (the logged
  ``epoch`` and the next epoch's data order must not shift);
* a ``OneCycleLR`` sized by ``trainer.estimated_stepping_batches`` in ``configure_optimizers`` (the
  loader then exists before the checkpoint is restored);
* negative controls: the same resumes from a checkpoint stripped of the resume state must differ:
  no loader position and no callback state (the epoch's data order starts over), and, with
  ``reseed_every_step=False``, everything but the RNG states (dropout and the validation noise then
  draw other numbers); and the OneCycleLR resume without handing the dropped loader states over.

The runs are started together (two cores) by one module-scoped fixture; most of each run's time
is importing Lightning, so fits share processes (``--then``): each uninterrupted run is the first fit of
its process (the two of "plain" in two processes) and is followed there by a run that is killed; each
negative control is the first fit of its process and is followed there by its scenario's resume, which
must still equal the uninterrupted run.
"""

from __future__ import annotations

import glob
import shutil
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

_SCRIPT = Path(__file__).with_name("_run_fit.py")
WALL_CLOCK_PREFIX = "perf/"  # throughput scalars measure wall-clock time: never reproducible, by design
_KILL_AT = 11  # checkpoints every 3 steps: last one at step 9, killed at the start of step 12
_ONECYCLE = ["--scheduler", "onecycle", "--max-steps", "-1", "--max-epochs", "3"]
_SCENARIOS = {
    # name: (module, extra args, kill at)
    "plain": ("plain", [], _KILL_AT),
    "plain_noreseed": ("plain", ["--no-reseed"], _KILL_AT),
    "deepep": ("deepep", [], _KILL_AT),
    # checkpoint after the epoch's last batch (8 batches per epoch), killed 2 steps into the next epoch:
    # the resumed run must start epoch 1 at batch 0 (once logged epoch 2 and drew another order)
    "plain_epoch_end": ("plain", ["--ckpt-every", "8"], 10),
    # OneCycleLR sized by estimated_stepping_batches over 3 epochs (24 steps): the loader exists before
    # the restore, and Lightning alone would drop its checkpointed position (Lightning #20550)
    "plain_onecycle": ("plain", _ONECYCLE, _KILL_AT),
}
_STEPS = {"plain_onecycle": 24}  # the others: max_steps=20
# checkpoints every 8 steps instead of 3 leave the training as it is: "plain_epoch_end" is compared with
# the uninterrupted run of "plain" (bitwise the same run, measured), which fits once
_REFERENCE = {"plain_epoch_end": "plain"}


def _start(fit_process, module: str, out: Path, extra: list[str], then: tuple[tuple[str, Path, list[str]], ...] = ()):
    """``_run_fit.py`` in a fresh process, then the fits ``then`` (module, directory, arguments) in turn in it."""
    args: list[str] = []
    for fit_module, fit_out, fit_extra in ((module, out, extra), *then):
        fit_out.mkdir(parents=True, exist_ok=True)
        args += [*(["--then"] if args else []), "--module", fit_module, "--out", str(fit_out)]
        args += ["--tb", str(fit_out / "tb"), *fit_extra]
    return fit_process(_SCRIPT, args, log_path=out / "log.txt")


def _wait(processes: dict, expect_killed: set[str]) -> None:
    for name, process in processes.items():
        code = process.wait()
        expected = -9 if name in expect_killed else 0
        assert code == expected, f"{name}: exit code {code}, expected {expected}\n{process.output_tail(3000)}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, fit_process) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    dirs = {f"{name}/killed": root / name / "killed" for name in _SCENARIOS}
    dirs |= {f"{name}/full": root / name / "full" for name in _SCENARIOS if name not in _REFERENCE}
    dirs["plain/full_again"] = root / "plain" / "full_again"
    # each killed run after an uninterrupted one; plain_epoch_end's after the second uninterrupted plain run
    after = {name: f"{_REFERENCE.get(name, name)}/full" for name in _SCENARIOS}
    after["plain_epoch_end"] = "plain/full_again"
    first: dict = {}
    for name, (module, extra, kill_at) in _SCENARIOS.items():
        killed = (module, dirs[f"{name}/killed"], [*extra, "--kill-at", str(kill_at)])
        reference = after[name]
        ref_module, ref_extra, _ = _SCENARIOS[reference.split("/")[0]]
        first[name] = _start(fit_process, ref_module, dirs[reference], ref_extra, then=(killed,))
    _wait(first, expect_killed=set(first))

    second: dict = {}
    for name, (module, extra, _) in _SCENARIOS.items():
        killed = root / name / "killed"
        # negative controls: resume state stripped (data order restarts) / everything kept but the RNG
        negative = {
            "plain": ["--strip-resume-state", "all"],
            "plain_noreseed": ["--strip-resume-state", "rng"],
            "plain_onecycle": ["--skip-pending-loader-states"],
        }
        variants = {**({"unrestored": negative[name]} if name in negative else {}), "resumed": []}
        fits = []
        for variant, more in variants.items():
            dirs[f"{name}/{variant}"] = out = root / name / variant
            shutil.copytree(killed, out)  # same checkpoint and the killed run's event file
            fits.append((module, out, extra + more + ["--resume", str(out / "last.ckpt")]))
        second[name] = _start(fit_process, *fits[0], then=tuple(fits[1:]))  # the negative control first
    _wait(second, expect_killed=set())
    return dirs


def _final_state(out: Path) -> dict[str, torch.Tensor]:
    saved = torch.load(out / "final.pt", weights_only=True)
    return {f"{part}.{key}": value for part, values in saved.items() for key, value in values.items()}


def _scalars(out: Path) -> dict[str, dict[int, float]]:
    """Every scalar of every event file in the run's TB dir, except wall-clock ``perf/`` tags.

    A step written twice (the killed run logged it, the resumed run replayed it) keeps its first
    value and, when the replay logged another value, is recorded under ``"<tag> (replayed)"`` so
    the comparison with the uninterrupted run fails.
    """
    series: dict[str, dict[int, float]] = {}
    files = sorted(glob.glob(str(out / "tb" / "events.out.tfevents.*")))
    assert files, f"no event file under {out / 'tb'}"
    for path in files:
        accumulator = EventAccumulator(path, size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            if tag.startswith(WALL_CLOCK_PREFIX):
                continue
            for event in accumulator.Scalars(tag):
                value = "nan" if event.value != event.value else event.value  # NaN (no episode yet) == NaN here
                seen = series.setdefault(tag, {})
                if event.step in seen and seen[event.step] != value:
                    series.setdefault(f"{tag} (replayed)", {})[event.step] = value
                seen.setdefault(event.step, value)
    return series


def _differences(reference: Path, other: Path) -> list[str]:
    ref, oth = _final_state(reference), _final_state(other)
    assert ref.keys() == oth.keys()
    different = [key for key in ref if not torch.equal(ref[key], oth[key])]
    if _scalars(reference) != _scalars(other):
        different.append("tensorboard scalars")
    return different


@pytest.mark.slow
def test_two_fresh_runs_are_bitwise_equal(runs: dict[str, Path]) -> None:
    assert _differences(runs["plain/full"], runs["plain/full_again"]) == []
    assert "train/loss" in _scalars(runs["plain/full"]) and "val/loss" in _scalars(runs["plain/full"])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(_SCENARIOS))
def test_sigkill_mid_epoch_then_resume_is_bitwise_equal(runs: dict[str, Path], scenario: str) -> None:
    full = runs[f"{_REFERENCE.get(scenario, scenario)}/full"]
    scalars = _scalars(full)
    steps = _STEPS.get(scenario, 20)
    assert len(scalars["train/loss"]) == steps, f"the uninterrupted run should log every one of its {steps} steps"
    assert _differences(full, runs[f"{scenario}/resumed"]) == []


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["plain", "plain_noreseed", "plain_onecycle"])
def test_negative_control_resume_without_restoring_differs(runs: dict[str, Path], scenario: str) -> None:
    different = _differences(runs[f"{scenario}/full"], runs[f"{scenario}/unrestored"])
    assert different, "a resume without the restore must differ; otherwise the resume test cannot fail"
    assert "tensorboard scalars" in different and any(key.startswith("model.") for key in different)


@pytest.mark.slow
def test_checkpoint_loads_with_weights_only(runs: dict[str, Path]) -> None:
    checkpoint = torch.load(runs["plain/killed"] / "last.ckpt", weights_only=True)
    state = checkpoint["callbacks"]["DeterminismCallback"]
    assert set(state["rng"]) >= {"torch", "numpy", "python", "cuda", "generators"}
    assert state["fingerprint"]["torch"] == torch.__version__
    assert checkpoint["global_step"] == 9


# ----------------------------------------------------------------------------- GPU
# The determinism properties do not depend on size, so the GPU check uses a smaller DeepEP than
# configs/gpu.yaml (whose eager steps and process start make a case take minutes).
_GPU_SETTINGS = {"num_envs": 64, "rollout_length": 32, "hidden_size": 64, "steps_per_epoch": 7}


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda_graph"])
def test_gpu_two_runs_and_sigkill_resume_are_bitwise_equal(tmp_path: Path, cuda_graph: bool, fit_process) -> None:
    import json

    extra = ["--accelerator", "gpu", "--deepep-args", json.dumps({**_GPU_SETTINGS, "cuda_graph": cuda_graph})]
    run = {name: tmp_path / name for name in ("full", "full_again", "killed")}
    _wait({"full": _start(fit_process, "deepep", run["full"], extra)}, set())
    _wait({"full_again": _start(fit_process, "deepep", run["full_again"], extra)}, set())
    _wait({"killed": _start(fit_process, "deepep", run["killed"], extra + ["--kill-at", str(_KILL_AT)])}, {"killed"})
    resumed = tmp_path / "resumed"
    shutil.copytree(run["killed"], resumed)
    _wait({"resumed": _start(fit_process, "deepep", resumed, extra + ["--resume", str(resumed / "last.ckpt")])}, set())
    assert _differences(run["full"], run["full_again"]) == []
    assert _differences(run["full"], resumed) == []
