"""Shared test setup: small thread pools (CI has 2 cores), GPU markers that skip cleanly, and fixtures.

Every test runs with the process-global determinism settings restored afterwards (deterministic
algorithms, cuDNN flags, the ``configure()`` record, the environment variables it sets, the torch
CPU RNG), so a test that configures determinism cannot change the tests after it.

Fixtures for every test directory:

* ``boring_module``: the class :class:`BoringModule`, the smallest module a Trainer can fit (as
  Lightning's ``BoringModel``); build it as ``boring_module(dropout=0.5)``.
* ``quiet_trainer``: :func:`quiet_trainer`, a CPU ``Trainer`` factory without logger, progress
  bar, model summary or checkpoints (``quiet_trainer(max_steps=4, callbacks=[...])``).
* ``fit_process``: the class :class:`FitProcess`, which runs a test script (a fit) in a fresh
  Python process with a hard timeout that kills every process the script started.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

import deepep_lightning.determinism.configuration as configure_module

torch.set_num_threads(1)
# A seeded default generator, as in a reproducible script: DeterminismCallback refuses a model whose
# weights come from torch's unseeded start-up generator (tests of that run in fresh processes).
torch.manual_seed(0)

REPO = Path(__file__).resolve().parents[1]

# set by Lightning's launcher or a parent run: a child must start its own process group
_LAUNCHER_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    n_gpus = torch.cuda.device_count() if has_cuda else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA devices")
    for item in items:
        # markers, not keywords: a parameter id such as "gpu" must not skip a CPU test
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("multigpu") and n_gpus < 2:
            item.add_marker(skip_multi)


_DETERMINISM_ENV = (
    "CUBLAS_WORKSPACE_CONFIG",
    "PYTHONHASHSEED",
    "PL_SEED_WORKERS",
    "PL_GLOBAL_SEED",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_NVLS_ENABLE",
    "NCCL_COLLNET_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
)


def _determinism_state() -> tuple:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        configure_module._last_record,
        {name: os.environ.get(name) for name in _DETERMINISM_ENV},
        torch.get_rng_state(),
    )


def _restore_determinism_state(saved: tuple) -> None:
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.utils.deterministic.fill_uninitialized_memory = saved[2]  # type: ignore[attr-defined]
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[3], saved[4]
    configure_module._last_record = saved[5]
    for name, value in saved[6].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    torch.set_rng_state(saved[7])


# configure(), DeterminismCallback and the strategy change process-wide flags, variables and seeds.
# Both scopes: a module-scoped fixture that configures runs after the module-scoped save (autouse
# fixtures come first in their scope), so the module's tests keep it and the next module does not.
@pytest.fixture(autouse=True, scope="module")
def _restore_determinism_after_the_module():
    saved = _determinism_state()
    yield
    _restore_determinism_state(saved)


@pytest.fixture(autouse=True)
def _restore_determinism_after_the_test():
    saved = _determinism_state()
    yield
    _restore_determinism_state(saved)


def boring_data(num_samples: int = 32, in_features: int = 4, seed: int = 0) -> torch.Tensor:
    """``[num_samples, in_features]`` standard-normal points, a pure function of ``seed``."""
    return torch.randn(num_samples, in_features, generator=torch.Generator().manual_seed(seed))


class BoringModule(pl.LightningModule):
    """An MLP trained to output 0 on fixed random points; records every training loss in ``losses``.

    ``validation_step`` draws from the global RNG, so a test can check that evaluation does not
    shift the training stream (it runs only when the Trainer validates).

    Args:
        in_features: width of the input points.
        num_samples: size of the train set (the validation set has 8 zero points).
        batch_size: of both loaders.
        dropout: between the two layers (``> 0``: training draws from the global RNG).
        lr: of the SGD optimizer.
    """

    def __init__(
        self, in_features: int = 4, num_samples: int = 32, batch_size: int = 4, dropout: float = 0.0, lr: float = 0.1
    ) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(in_features, 8), torch.nn.Dropout(dropout), torch.nn.Linear(8, 1)
        )
        self.in_features, self.num_samples, self.batch_size, self.lr = in_features, num_samples, batch_size, lr
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.net(batch).pow(2).mean()
        self.losses.append(loss.item())
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        torch.rand(100)  # evaluation that consumes the global RNG

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = boring_data(self.num_samples, self.in_features)
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)  # type: ignore[arg-type]

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.zeros(8, self.in_features)
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)  # type: ignore[arg-type]


_QUIET_TRAINER = {
    "accelerator": "cpu",
    "devices": 1,
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


def quiet_trainer(**overrides: Any) -> pl.Trainer:
    """A CPU ``Trainer`` that writes nothing and prints little; ``overrides`` win over those defaults."""
    return pl.Trainer(**{**_QUIET_TRAINER, **overrides})


class FitProcess:
    """A test script (usually one ``fit``) running in a fresh Python process, in its own session.

    The environment is this one without the launcher variables, with the repository on
    ``PYTHONPATH`` and one OpenMP thread; output goes to ``log_path``. :meth:`wait` kills the whole
    session afterwards (and on a timeout, failing the test), so no rank or DataLoader worker
    outlives the test.

    Example::

        process = FitProcess(script, ["--out", str(out)], log_path=out / "log.txt")
        assert process.wait(timeout_s=180) == 0, process.output_tail()
    """

    def __init__(self, script: Path | str, args: list[str], *, log_path: Path, cwd: Path | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env["OMP_NUM_THREADS"] = "1"
        self.script, self.args, self.log_path = Path(script), list(args), Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:  # the child holds its own descriptor
            self.process = subprocess.Popen(
                [sys.executable, str(script), *self.args],
                cwd=str(cwd or REPO),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait(self, timeout_s: float) -> int:
        """The exit code (``-9`` after a SIGKILL); fails the test when the script runs past ``timeout_s``."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._kill_session()
            self.process.wait()
            command = " ".join([self.script.name, *self.args])
            pytest.fail(f"{command} did not finish in {timeout_s} s\n{self.output_tail()}")
        finally:
            self._kill_session()

    def output_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def _kill_session(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture(scope="session")
def boring_module() -> type[BoringModule]:
    return BoringModule


@pytest.fixture(scope="session", name="quiet_trainer")
def _quiet_trainer_fixture():
    return quiet_trainer


@pytest.fixture(scope="session")
def fit_process() -> type[FitProcess]:
    return FitProcess
