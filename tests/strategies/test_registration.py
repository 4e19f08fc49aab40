"""Registration of "ddp_deterministic": the import of ``deepep_lightning`` registers it, idempotently."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.strategies import StrategyRegistry

from deepep_lightning.strategies import DeterministicDDPStrategy

_ROOT = Path(__file__).resolve().parents[2]

_TRAINER = (
    "from lightning.pytorch import Trainer\n"
    "trainer = Trainer(strategy='ddp_deterministic', accelerator='cpu', devices=2, logger=False)\n"
    "print(type(trainer.strategy).__name__)\n"
)


def _fresh_process(run_process, code: str) -> subprocess.CompletedProcess:
    return run_process([sys.executable, "-c", code], cwd=_ROOT, env=dict(os.environ))


@pytest.mark.slow
def test_import_deepep_lightning_makes_the_name_work_in_a_fresh_process(run_process):
    result = _fresh_process(run_process, "import deepep_lightning\n" + _TRAINER)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "DeterministicDDPStrategy"
    # negative control: without the import, Lightning does not know the name
    unregistered = _fresh_process(run_process, _TRAINER)
    assert unregistered.returncode != 0
    assert "ddp_deterministic" in unregistered.stderr


def test_registration_is_idempotent_and_registers_the_class():
    assert StrategyRegistry["ddp_deterministic"]["strategy"] is DeterministicDDPStrategy
    DeterministicDDPStrategy.register_strategies(StrategyRegistry)  # a second call replaces, never raises
    DeterministicDDPStrategy.register_strategies(StrategyRegistry)
    assert StrategyRegistry["ddp_deterministic"]["strategy"] is DeterministicDDPStrategy
    assert list(StrategyRegistry).count("ddp_deterministic") == 1
