"""Where DeterminismCallback takes its seed from, and what constructing it leaves alone (``callback.py``)."""

from __future__ import annotations

import logging
import os
import random
import textwrap
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

import deepep_lightning.determinism.configuration as configure_module
from deepep_lightning.determinism import DeterminismCallback, configure

_RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"  # where rank_zero_info writes


def _checkpointed_seed(tmp_path: Path, quiet_trainer, boring_module, callback: DeterminismCallback) -> int:
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(boring_module())
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=True)["callbacks"]["DeterminismCallback"]["seed"]


@pytest.fixture
def rank_zero_messages():
    """What ``rank_zero_info`` logs during the test (its logger does not propagate to pytest's handler)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, handler = logging.getLogger(_RANK_ZERO_LOGGER), Collect(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield messages
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def no_seed_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    monkeypatch.setattr(configure_module, "_last_record", None)


def test_the_seed_from_seed_everything_reaches_the_checkpoint(
    tmp_path: Path, quiet_trainer, boring_module, no_seed_anywhere, rank_zero_messages: list[str]
) -> None:
    pl.seed_everything(5, verbose=False)
    callback = DeterminismCallback()
    assert _checkpointed_seed(tmp_path, quiet_trainer, boring_module, callback) == 5
    assert callback.seed == 5
    said = [m for m in rank_zero_messages if m.startswith("DeterminismCallback: seed")]
    assert said == [
        "DeterminismCallback: seed 5 (from Lightning's global seed (PL_GLOBAL_SEED, set by `seed_everything`))"
    ]


def test_negative_control_without_any_seed_the_checkpoint_says_0(
    tmp_path: Path, quiet_trainer, boring_module, no_seed_anywhere, rank_zero_messages: list[str]
) -> None:
    assert _checkpointed_seed(tmp_path, quiet_trainer, boring_module, DeterminismCallback()) == 0
    assert any(m.startswith("DeterminismCallback: seed 0 (from the default") for m in rank_zero_messages)


def test_seed_everything_after_construction_still_counts(
    tmp_path: Path, quiet_trainer, boring_module, no_seed_anywhere
) -> None:
    callback = DeterminismCallback()
    pl.seed_everything(9, verbose=False)  # the seed is settled at setup, not at construction
    assert _checkpointed_seed(tmp_path, quiet_trainer, boring_module, callback) == 9


def test_an_earlier_configure_seed_is_used_without_seed_everything(
    tmp_path: Path, quiet_trainer, boring_module, no_seed_anywhere
) -> None:
    configure(4)
    assert _checkpointed_seed(tmp_path, quiet_trainer, boring_module, DeterminismCallback()) == 4


def test_an_explicit_seed_that_disagrees_with_seed_everything_warns_naming_both(
    boring_module, quiet_trainer, no_seed_anywhere
) -> None:
    pl.seed_everything(42, verbose=False)
    trainer = quiet_trainer(max_steps=1)
    with pytest.warns(UserWarning, match=r"seed=7 disagrees with .*PL_GLOBAL_SEED=42"):
        DeterminismCallback(7).setup(trainer, boring_module(), "fit")
    with warnings.catch_warnings():  # negative control: the same seed is quiet
        warnings.simplefilter("error")
        DeterminismCallback(42).setup(trainer, boring_module(), "fit")


def _global_state() -> tuple:
    return (
        torch.get_rng_state(),
        np.random.get_state(legacy=True)[1].copy(),
        random.getstate(),
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        dict(os.environ),
        configure_module._last_record,
    )


def _same(a: tuple, b: tuple) -> bool:
    return (
        torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2] and a[3:] == b[3:]  # type: ignore[operator]
    )


def test_constructing_the_callback_changes_no_global_state(monkeypatch: pytest.MonkeyPatch, no_seed_anywhere) -> None:
    for name in ("CUBLAS_WORKSPACE_CONFIG", "PYTHONHASHSEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
    torch.manual_seed(123)
    before = _global_state()
    DeterminismCallback(7)
    DeterminismCallback()
    DeterminismCallback(3, deterministic_algorithms=False, cublas_workspace_config=":16:8")
    assert _same(before, _global_state())
    assert not torch.are_deterministic_algorithms_enabled()
    configure(7)  # negative control: configure, called on purpose, changes all of it
    after = _global_state()
    assert not torch.equal(before[0], after[0]) and not np.array_equal(before[1], after[1]) and before[2] != after[2]
    assert torch.are_deterministic_algorithms_enabled() and os.environ["PL_GLOBAL_SEED"] == "7"


_SCRIPT = """
import os, sys, warnings
os.environ["OMP_NUM_THREADS"] = "1"
import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from deepep_lightning import DeterminismCallback

mode = sys.argv[1]
accelerator = "cuda" if mode.startswith("cuda") else "cpu"
if mode == "cuda_exported":  # the user's own setting: the callback keeps it
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
if mode != "unseeded" and mode != "strict":
    pl.seed_everything(3, verbose=False)
if mode == "cuda_used":  # a GEMM before fit: cuBLAS has sized its workspace, too late for the setting
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
model = torch.nn.Linear(4, 1)  # initial weights drawn from the default generator


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = model

    def training_step(self, batch, batch_idx):
        print("CUBLAS_WORKSPACE_CONFIG in the step:", os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(8, 4), batch_size=4)


trainer = pl.Trainer(
    accelerator=accelerator, devices=1, max_steps=1, logger=False, enable_progress_bar=False,
    enable_checkpointing=False,
    callbacks=[DeterminismCallback(3, strict=mode != "unseeded")],
)
try:
    trainer.fit(Module())
except MisconfigurationException as error:
    print("REFUSED:", error)
    sys.exit(3)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "exit_code", "warned"),
    [("unseeded", 0, True), ("strict", 3, True), ("seeded", 0, False)],
    ids=["warns", "strict_refuses", "negative_control_seed_everything_first"],
)
def test_a_model_built_before_any_seed_is_reported(
    tmp_path: Path, fit_process, mode: str, exit_code: int, warned: bool
) -> None:
    script = tmp_path / "unseeded.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    process = fit_process(script, [mode], log_path=tmp_path / "log.txt")
    assert process.wait() == exit_code, process.output_tail()
    output = process.output_tail(20000)
    assert ("before any seed was set" in output) is warned, output
    if warned:
        assert "HINT: call `lightning.pytorch.seed_everything(seed)`" in output
    assert ("REFUSED:" in output) is (mode == "strict")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("mode", "exit_code", "in_the_step"),
    [("cuda_fresh", 0, "None"), ("cuda_used", 3, None), ("cuda_exported", 0, ":4096:8")],
    ids=["setup_configures_in_time", "negative_control_gemm_before_fit_is_refused", "a_user_export_is_kept"],
)
def test_setup_configures_cuda_in_time_unless_cublas_already_ran(
    tmp_path: Path, fit_process, mode: str, exit_code: int, in_the_step: str | None
) -> None:
    """Trainer starts CUDA (``set_device``) before the callback's ``setup``; no cuBLAS call has run by then.

    The training steps run without the ``CUBLAS_WORKSPACE_CONFIG`` that ``configure()`` set (released at train
    start once cuBLAS has read it: some PyTorch versions parse it on every cuBLAS call), and with the value a
    user exported."""
    script = tmp_path / "cuda_setup.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    process = fit_process(script, [mode], log_path=tmp_path / "log.txt")
    assert process.wait() == exit_code, process.output_tail()
    output = process.output_tail(20000)
    assert ("REFUSED:" in output and "CUBLAS_WORKSPACE_CONFIG" in output) is (exit_code == 3), output
    if in_the_step is not None:
        assert f"CUBLAS_WORKSPACE_CONFIG in the step: {in_the_step}" in output, output


def test_lightning_cli_seed_everything_reaches_the_checkpoint(tmp_path: Path, boring_module, no_seed_anywhere) -> None:
    from lightning.pytorch.cli import LightningCLI

    args = ["fit", "--seed_everything=5", "--trainer.max_steps=2", "--trainer.limit_val_batches=0"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = LightningCLI(
            boring_module,
            trainer_defaults={
                "accelerator": "cpu",
                "logger": False,
                "enable_progress_bar": False,
                "enable_checkpointing": False,
                "callbacks": [DeterminismCallback()],
            },
            save_config_callback=None,
            args=args,
        )
    path = tmp_path / "cli.ckpt"
    cli.trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=True)["callbacks"]["DeterminismCallback"]["seed"] == 5
