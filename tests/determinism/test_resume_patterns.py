"""Exact resume with the patterns Lightning users write (issue #21, item 7), and resume without the plugin.

Every SIGKILL scenario runs ``_run_fit.py`` (the plain module: shuffled loader, 2 workers, random
augmentation, dropout, validation that draws from the global RNG) in fresh processes: an
uninterrupted run, a run SIGKILLed mid-epoch after a checkpoint, and the killed run resumed from that
checkpoint, compared bitwise (weights, optimizer state and every TensorBoard scalar):

* ``stateful_dataloader``: torchdata's ``StatefulDataLoader`` as the train loader (DeterminismCallback
  rebuilds it as a seekable loader);
* ``accumulate``: ``accumulate_grad_batches=3``; the checkpoint and the kill both land inside an
  accumulation window (the checkpoint carries the window's gradients);
* ``val_check_interval``: ``val_check_interval=0.5``, checkpoints written by Lightning's
  ``ModelCheckpoint(save_last=True)`` at each validation end, killed two steps after a mid-epoch one;
* ``datamodule``: the loaders come from a ``LightningDataModule``;
* ``warmup_cosine`` / ``warmup_cosine_sequential``: linear warm-up then cosine decay with
  ``interval="step"``, as one ``LambdaLR`` / as ``SequentialLR(LinearLR, CosineAnnealingLR)``, sized
  by ``trainer.estimated_stepping_batches`` in ``configure_optimizers``.

``stateful_dataloader``, ``val_check_interval`` and ``datamodule`` change where the loaders come from and
who writes the checkpoints, not the training: their uninterrupted runs are bitwise the plain module's
(measured), so the three resumes and their negative controls are compared with one uninterrupted run of
the plain module (``plain/full``), and the run fits once instead of three times.

Negative controls (each must differ, or the test above it could not fail): the accumulation resume
without the checkpointed gradients; the mid-epoch validation and DataModule resumes without the
train-loader position; the scheduler resumes without handing over the loader states Lightning drops
when ``estimated_stepping_batches`` builds the loader early (Lightning #20550); and a
``StatefulDataLoader`` left to its own state (``seekable_data=False``), which restarts the workers'
random streams from their seeds.

The fits share processes (``--then``; most of a run's time is importing Lightning): each uninterrupted
run is the first fit of its process and is followed there by a killed run; each negative control is the
first fit of its process and is followed there by its scenario's resume, which must still equal the
uninterrupted run (``stateful_dataloader``'s resume follows its negative control
``stateful_dataloader_own_state``).

In-process tests: a checkpoint written with DeterminismCallback resumes in a Trainer without it,
and loads with ``LightningModule.load_from_checkpoint``.
"""

from __future__ import annotations

import importlib.util
import shutil
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from test_resume import _differences, _scalars, _start, _wait

from deepep_lightning.determinism import DeterminismCallback
from deepep_lightning.determinism.data import SeekableDataLoader, put_back_loader_states
from deepep_lightning.determinism.train_loaders import make_train_loaders_seekable

_HAS_TORCHDATA = importlib.util.find_spec("torchdata") is not None
_NEEDS_TORCHDATA = pytest.mark.skipif(not _HAS_TORCHDATA, reason="torchdata (StatefulDataLoader) is not installed")

_EPOCHS = ["--max-steps", "-1", "--max-epochs"]
_SCHEDULE = [*_EPOCHS, "3"]  # 3 epochs of 8 batches: 24 optimizer steps
# name: (arguments, kill at, arguments of the negative control or None, optimizer steps of the whole run)
_SCENARIOS: dict[str, tuple[list[str], int, list[str] | None, int]] = {
    "stateful_dataloader": (["--loader", "stateful"], 11, None, 20),
    # 8 batches per epoch in windows [0-2] [3-5] [6-7]: checkpoints after batches 5 and 10 (epoch 1,
    # batches 0-1 of a window), killed before batch 12 (epoch 1, batch 4: inside the next window)
    "accumulate": (
        ["--accumulate", "3", "--unit", "batch", "--ckpt-every", "5", *_EPOCHS, "2"],
        12,
        ["--strip-resume-state", "gradients"],
        6,
    ),
    # validation after batches 4 and 8 of every epoch; ModelCheckpoint saves at step 12 (epoch 1,
    # mid-epoch), killed at the start of step 15
    "val_check_interval": (
        ["--val-check-interval", "0.5", "--model-checkpoint", "--ckpt-every", "0"],
        14,
        ["--strip-resume-state", "loader"],
        20,
    ),
    "datamodule": (["--datamodule"], 11, ["--strip-resume-state", "loader"], 20),
    "warmup_cosine": (["--scheduler", "warmup_cosine", *_SCHEDULE], 11, ["--skip-pending-loader-states"], 24),
    "warmup_cosine_sequential": (
        ["--scheduler", "warmup_cosine_sequential", *_SCHEDULE],
        11,
        ["--skip-pending-loader-states"],
        24,
    ),
    # negative control of the first: the StatefulDataLoader keeps (only) its own state
    "stateful_dataloader_own_state": (["--loader", "stateful", "--no-seekable-data"], 11, None, 20),
}
_STATEFUL = {"stateful_dataloader", "stateful_dataloader_own_state"}
_RUN = [name for name in _SCENARIOS if _HAS_TORCHDATA or name not in _STATEFUL]
# the scenarios whose uninterrupted run is the plain module's: compared with the one run "plain/full"
_PLAIN_REFERENCE = {"stateful_dataloader", "val_check_interval", "datamodule"}


def _full(runs: dict[str, Path], scenario: str) -> Path:
    """The uninterrupted run ``scenario``'s resumes are compared with."""
    return runs["plain/full" if scenario in _PLAIN_REFERENCE else f"{scenario}/full"]


def _param(name: str) -> Any:
    return pytest.param(name, marks=_NEEDS_TORCHDATA) if name in _STATEFUL else name


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, fit_process) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("patterns")
    dirs = {"plain/full": root / "plain" / "full"}
    # a process per uninterrupted run, its first fit, followed by a killed run; the other killed runs alone
    first: dict[str, list] = {}
    plain_killed = [name for name in _RUN if name in _PLAIN_REFERENCE]
    for name in _RUN:
        extra, kill_at, _, _ = _SCENARIOS[name]
        dirs[f"{name}/killed"] = root / name / "killed"
        killed = ("plain", dirs[f"{name}/killed"], [*extra, "--kill-at", str(kill_at)])
        if name not in _PLAIN_REFERENCE:
            dirs[f"{name}/full"] = root / name / "full"
            first[name] = [("plain", dirs[f"{name}/full"], extra), killed]
        elif name == plain_killed[0]:
            first[name] = [("plain", dirs["plain/full"], []), killed]
        else:
            first[name] = [killed]
    started = {name: _start(fit_process, *fits[0], then=tuple(fits[1:])) for name, fits in first.items()}
    _wait(started, expect_killed=set(started))

    second: dict[str, list] = {}
    for name in _RUN:
        extra, _, negative, _ = _SCENARIOS[name]
        killed = root / name / "killed"
        variants = {**({"unrestored": negative} if negative is not None else {}), "resumed": []}  # negative first
        second[name] = []
        for variant, more in variants.items():
            dirs[f"{name}/{variant}"] = out = root / name / variant
            shutil.copytree(killed, out)  # same checkpoint and the killed run's event file
            second[name].append(("plain", out, extra + more + ["--resume", str(out / "last.ckpt")]))
    if "stateful_dataloader_own_state" in second:  # its resume is stateful_dataloader's negative control
        second["stateful_dataloader_own_state"] += second.pop("stateful_dataloader")
    started = {name: _start(fit_process, *fits[0], then=tuple(fits[1:])) for name, fits in second.items()}
    _wait(started, expect_killed=set())
    return dirs


_EXACT = [name for name in _SCENARIOS if name != "stateful_dataloader_own_state"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [_param(name) for name in _EXACT])
def test_sigkill_mid_epoch_then_resume_is_bitwise_equal(runs: dict[str, Path], scenario: str) -> None:
    steps = _SCENARIOS[scenario][3]
    scalars = _scalars(_full(runs, scenario))
    assert len(scalars["train/loss"]) == steps, f"the uninterrupted run should log every one of its {steps} steps"
    assert _differences(_full(runs, scenario), runs[f"{scenario}/resumed"]) == []


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [name for name in _EXACT if _SCENARIOS[name][2] is not None])
def test_negative_control_resume_without_the_restore_differs(runs: dict[str, Path], scenario: str) -> None:
    different = _differences(_full(runs, scenario), runs[f"{scenario}/unrestored"])
    assert different, "a resume without the restore must differ; otherwise the resume test cannot fail"
    assert any(key.startswith("model.") for key in different)


@pytest.mark.slow
@_NEEDS_TORCHDATA
def test_negative_control_stateful_dataloader_left_to_its_own_state_differs(runs: dict[str, Path]) -> None:
    name = "stateful_dataloader_own_state"
    checkpoint = torch.load(runs[f"{name}/killed"] / "last.ckpt", weights_only=True)
    assert "train_loaders" not in checkpoint["callbacks"]["DeterminismCallback"]
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"], "Lightning keeps the loader's state"
    different = _differences(runs[f"{name}/full"], runs[f"{name}/resumed"])
    assert "tensorboard scalars" in different and any(key.startswith("model.") for key in different)


@pytest.mark.slow
def test_checkpoints_hold_what_each_pattern_needs(runs: dict[str, Path]) -> None:
    def load(name: str) -> dict[str, Any]:
        return torch.load(runs[f"{name}/killed"] / "last.ckpt", weights_only=True)

    if _HAS_TORCHDATA:
        stateful = load("stateful_dataloader")
        # rebuilt as a seekable loader: its position is the plugin's, Lightning's list holds nothing
        states = stateful["callbacks"]["DeterminismCallback"]["train_loaders"]["states"]
        assert states == [{"epoch": 1, "batches": 1}]
        assert "combined_loader" not in stateful["loops"]["fit_loop"]["state_dict"]
    accumulate = load("accumulate")
    assert accumulate["global_step"] == 3  # 10 batches: 3 full windows and 1 of 3 batches of the next
    gradients = accumulate["callbacks"]["DeterminismCallback"]["accumulated_gradients"]
    assert set(gradients) == {"net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"}
    validation = load("val_check_interval")
    assert (validation["global_step"], validation["epoch"]) == (12, 1), "written at the mid-epoch validation"
    assert "accumulated_gradients" not in validation["callbacks"]["DeterminismCallback"]


# ----------------------------------------------------------------------------- resume without the plugin
def _fit_with_plugin_and_save(tmp_path: Path, boring_module, quiet_trainer) -> tuple[Path, Any]:
    """Fit 3 of the 8 steps of an epoch with DeterminismCallback on a shuffled loader; save mid-epoch."""
    import lightning.pytorch as pl

    path = tmp_path / "mid_epoch.ckpt"

    class SaveAtStep3(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:
                trainer.save_checkpoint(path)

    class Shuffled(boring_module):
        def train_dataloader(self):
            loader = super().train_dataloader()
            return torch.utils.data.DataLoader(loader.dataset, batch_size=self.batch_size, shuffle=True)

    model = Shuffled(dropout=0.5)
    plugin = DeterminismCallback(3, log_fingerprint=False)
    trainer = quiet_trainer(max_steps=5, callbacks=[plugin, SaveAtStep3()])
    trainer.fit(model)
    assert isinstance(trainer.train_dataloader, SeekableDataLoader)
    return path, Shuffled


def test_plugin_checkpoint_resumes_in_plain_lightning(tmp_path: Path, boring_module, quiet_trainer) -> None:
    path, module_class = _fit_with_plugin_and_save(tmp_path, boring_module, quiet_trainer)
    checkpoint = torch.load(path, weights_only=True)
    assert "combined_loader" not in checkpoint["loops"]["fit_loop"]["state_dict"]

    trainer = quiet_trainer(max_steps=6)
    # Lightning itself names the missing callback; nothing fails
    with pytest.warns(UserWarning, match="DeterminismCallback"):
        trainer.fit(module_class(dropout=0.5), ckpt_path=str(path))
    assert trainer.global_step == 6

    # negative control: the loader position where Lightning keeps it, as it is without the plugin's move
    put_back_loader_states(checkpoint, checkpoint["callbacks"]["DeterminismCallback"]["train_loaders"])
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "batches": 3}]
    in_lightnings_list = tmp_path / "in_lightnings_list.ckpt"
    torch.save(checkpoint, in_lightnings_list)
    with pytest.raises(RuntimeError, match="0 stateful loaders"):
        quiet_trainer(max_steps=6).fit(module_class(dropout=0.5), ckpt_path=str(in_lightnings_list))


def test_plugin_checkpoint_resumes_exactly_with_the_plugin(tmp_path: Path, boring_module, quiet_trainer) -> None:
    """The moved loader position still reaches the loader when the plugin resumes (steps 4-5 repeat)."""
    import lightning.pytorch as pl

    path, module_class = _fit_with_plugin_and_save(tmp_path, boring_module, quiet_trainer)

    class Batches(pl.Callback):
        def __init__(self) -> None:
            self.seen: list[torch.Tensor] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen.append(batch.clone())

    def fit(ckpt_path: str | None, restore: bool) -> list[torch.Tensor]:
        batches = Batches()
        plugin = DeterminismCallback(3, log_fingerprint=False)
        if not restore:  # negative control: the plugin does not put its loader states back
            plugin.on_load_checkpoint = lambda trainer, module, checkpoint: None  # type: ignore[method-assign]
        quiet_trainer(max_steps=5, callbacks=[plugin, batches]).fit(module_class(dropout=0.5), ckpt_path=ckpt_path)
        return batches.seen

    uninterrupted = fit(None, restore=True)
    resumed = fit(str(path), restore=True)
    assert len(uninterrupted) == 5 and len(resumed) == 2
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted[3:], resumed))
    unrestored = fit(str(path), restore=False)
    assert not torch.equal(unrestored[0], uninterrupted[3]), "without the position the epoch starts over"


def test_load_from_checkpoint_without_the_plugin(tmp_path: Path, boring_module, quiet_trainer) -> None:
    path, module_class = _fit_with_plugin_and_save(tmp_path, boring_module, quiet_trainer)
    saved = torch.load(path, weights_only=True)["state_dict"]
    loaded = module_class.load_from_checkpoint(str(path), weights_only=True, dropout=0.5)
    assert saved.keys() == loaded.state_dict().keys()
    assert all(torch.equal(saved[key], value) for key, value in loaded.state_dict().items())
    fresh = module_class(dropout=0.5)  # negative control: the weights do come from the file
    assert not all(torch.equal(saved[key], value) for key, value in fresh.state_dict().items())


@_NEEDS_TORCHDATA
def test_a_stateful_dataloader_it_cannot_rebuild_keeps_its_own_state_and_says_so(monkeypatch) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    class DatasetWithState(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.tensor([float(index)])

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            pass

    loader = StatefulDataLoader(DatasetWithState(), batch_size=2, shuffle=True)

    def make_seekable(loader: StatefulDataLoader) -> object:  # strict, as DeterminismCallback(0) is
        return make_train_loaders_seekable(loader, seed=0, rank=0, world_size=1, strict=True, made=weakref.WeakSet())

    said: list[str] = []
    monkeypatch.setattr("deepep_lightning.determinism.train_loaders.rank_zero_info", said.append)
    assert make_seekable(loader) is loader
    assert len(said) == 1 and "StatefulDataLoader" in said[0] and "checkpoints its own state_dict" in said[0]
    rebuilt = make_seekable(StatefulDataLoader(list(range(4)), batch_size=2, shuffle=True))
    assert isinstance(rebuilt, SeekableDataLoader) and len(said) == 1  # negative control: the plain case, silently
