"""A model built before any seed is refused under DDP as in one process, whatever the launcher.

Under ``ddp_deterministic`` the strategy seeds every rank before the callbacks' ``setup``, which hid the
unseeded draws from DeterminismCallback's check; under ``ddp_spawn`` the model is built in the launching
process and pickled, so a spawned rank's fresh generator shows nothing (and the callback itself did not
pickle). Plain ``ddp`` is covered by the one-process check: nothing seeds before the callback there. Each
case runs 2 real gloo processes (refused at setup, so each run is short).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

_SCRIPT = """
import os, sys
os.environ["OMP_NUM_THREADS"] = "1"
import lightning.pytorch as pl
import torch
from deepep_lightning import DeterminismCallback


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)  # initial weights drawn from the default generator

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


if __name__ == "__main__":
    strategy, seeded = sys.argv[1], sys.argv[2] == "seeded"
    if seeded:
        pl.seed_everything(3, verbose=False)
    model = Module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[DeterminismCallback(3)],
    )
    try:
        trainer.fit(model)
    except Exception as error:  # ddp_spawn re-raises a rank's MisconfigurationException as its own type
        print("REFUSED:", type(error).__name__, error, flush=True)
        sys.exit(3)
    if trainer.global_rank == 0:
        print("FINISHED", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "seeded", "exit_code"),
    [
        ("ddp_deterministic", "unseeded", 3),
        ("ddp_spawn", "unseeded", 3),
        ("ddp_spawn", "seeded", 0),
    ],
    ids=["ddp_deterministic", "ddp_spawn", "negative_control_spawn_seeded_runs"],
)
def test_an_unseeded_model_is_refused_on_two_gloo_ranks(
    tmp_path: Path, fit_process, strategy: str, seeded: str, exit_code: int
) -> None:
    script = tmp_path / "unseeded_ddp.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    process = fit_process(script, [strategy, seeded], log_path=tmp_path / "log.txt", cwd=tmp_path)
    assert process.wait() == exit_code, process.output_tail()
    output = process.output_tail(20000)
    if exit_code:
        assert "REFUSED:" in output and "before any seed was set" in output, output
        assert "HINT: call `lightning.pytorch.seed_everything(seed)`" in output
    else:
        assert "FINISHED" in output and "before any seed" not in output, output


_PROBE = """
import torch
import deepep_lightning
from deepep_lightning.determinism.rng import (
    default_generator_is_unseeded, seed_everything_from, unseeded_draws_before_first_seed,
)
torch.nn.Linear(4, 4)  # drawn from the unseeded start-up generator
seed_everything_from(3, "rank", 0)  # what ddp_deterministic does before the callbacks' setup
print(default_generator_is_unseeded(), unseeded_draws_before_first_seed())
seed_everything_from(3, "micro", 0, 1)  # the plugin's later seeding keeps the finding
print(unseeded_draws_before_first_seed())
torch.manual_seed(5)  # a seed the user sets (seed_everything) ends it
print(unseeded_draws_before_first_seed())
"""


def test_the_plugins_own_seeding_no_longer_hides_unseeded_draws(run_process) -> None:
    result = run_process([sys.executable, "-c", _PROBE])
    assert result.returncode == 0, result.stdout + result.stderr
    # negative control, first value: the start-up check alone is blind once the plugin has seeded
    assert result.stdout.split() == ["False", "True", "True", "False"], result.stdout + result.stderr
