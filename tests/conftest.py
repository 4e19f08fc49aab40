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
  Python process under a progress-based deadline and kills every process the script started.
* ``run_process``: :func:`run_process`, ``subprocess.run`` for any command under that deadline.
* ``child_process``: the class :class:`ChildProcess` they are built on, for any command.

Subprocesses have no wall-clock limit, which a busy machine makes them exceed: they fail when they
make no progress (no new output and under half a CPU second in their whole session) for
:data:`IDLE_TIMEOUT_S`. The C++ extension is built once at session start, before pytest-xdist starts
its workers, so no test waits on another process's build.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import contextlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
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


# seconds a subprocess may go without output and without using CPU before the test fails
IDLE_TIMEOUT_S = float(os.environ.get("DEEPEP_LIGHTNING_TEST_IDLE_TIMEOUT_S", "180"))
# CPU seconds its session must use to count as progress (at most a twentieth of the idle limit): more
# than idle threads and polls use
CPU_PROGRESS_S = 0.5


def pytest_sessionstart(session):
    """Build (or load) the C++ extension once, before any test or xdist worker needs it."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller has built it
        return
    from deepep_lightning.ops import extension_available

    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        extension_available()  # the loader prints its build lines (rank 0) or falls back with a warning


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
    # the files of slow tests (real subprocesses, long fits) first: pytest-xdist hands files out in this
    # order (check.sh passes --no-loadscope-reorder), so the last files to start are short ones and no
    # worker idles while another finishes a long file
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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


def _session_cpu_seconds(session_id: int) -> float:
    """CPU seconds used by the live processes of a session (and the children they reaped); Linux only."""
    ticks = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as handle:
                    stat = handle.read()
            except OSError:  # exited meanwhile
                continue
            fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, pgrp, session
            if int(fields[3]) == session_id:
                ticks += sum(int(field) for field in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


# Ports for the process groups of child runs: below Linux's ephemeral range (32768-60999), where no socket
# bound to port 0 lands. A port picked by binding to 0 is free only until its store binds it: a gloo pair's
# listener or a client socket of a concurrent test can take it in between, and a rank then connects to
# another job's socket.
_PORT_RANGE = (20000, 32000)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, drawn at random from :data:`_PORT_RANGE`."""
    draw = random.SystemRandom()  # not the global generator: tests seed it, and the xdist workers alike
    for _ in range(200):
        port = draw.randrange(*_PORT_RANGE)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port found in {_PORT_RANGE[0]}-{_PORT_RANGE[1] - 1} after 200 draws")


def subprocess_env(**overrides: str) -> dict[str, str]:
    """This environment without the launcher variables, with the repository on ``PYTHONPATH``, one
    OpenMP thread and a ``MASTER_PORT`` of its own from :func:`free_port`; ``overrides`` on top."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["MASTER_PORT"] = str(free_port())
    env.update(overrides)
    return env


class ChildProcess:
    """A command running in its own session, with a deadline that moves while it makes progress.

    Progress is new output (``stdout_path`` or ``stderr_path`` grew) or :data:`CPU_PROGRESS_S` more CPU
    seconds used by the processes of its session: a fit on a busy machine runs slower but keeps going, a hung one (a
    deadlock, a rank waiting for a peer that died) stops both. :meth:`wait` kills the whole session
    afterwards (and when the deadline passes, failing the test), so no rank or DataLoader worker
    outlives the test.

    Args:
        command: the argv.
        stdout_path: file for its standard output (and its standard error without ``stderr_path``).
        stderr_path: file for its standard error.
        cwd: working directory (default: the repository).
        env: its environment (default: :func:`subprocess_env`).

    Example::

        process = ChildProcess([sys.executable, "-c", "print(1)"], stdout_path=tmp_path / "out.txt")
        assert process.wait() == 0, process.output_tail()
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        stdout_path: Path,
        stderr_path: Path | None = None,
        cwd: Path | str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.command = [str(part) for part in command]
        self.paths = [Path(stdout_path)] + ([Path(stderr_path)] if stderr_path is not None else [])
        for path in self.paths:
            path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as files:  # the child holds its own descriptors
            out = files.enter_context(open(self.paths[0], "w"))
            err = files.enter_context(open(self.paths[1], "w")) if stderr_path is not None else subprocess.STDOUT
            self.process = subprocess.Popen(
                self.command,
                cwd=str(cwd or REPO),
                env=subprocess_env() if env is None else env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def wait(self, idle_timeout_s: float = IDLE_TIMEOUT_S) -> int:
        """The exit code (``-9`` after a SIGKILL); fails the test after ``idle_timeout_s`` without progress."""
        cpu_progress_s = min(CPU_PROGRESS_S, idle_timeout_s / 20)  # a short limit needs less CPU per window
        try:
            progress = self._progress()
            last_progress_at = time.monotonic()
            while True:
                try:
                    return self.process.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
                now = self._progress()
                if now[0] != progress[0] or now[1] >= progress[1] + cpu_progress_s or now[1] < progress[1]:
                    progress, last_progress_at = now, time.monotonic()
                elif time.monotonic() - last_progress_at > idle_timeout_s:
                    self.kill()
                    self.process.wait()
                    pytest.fail(
                        f"{' '.join(self.command)[:500]} made no progress (no output, no CPU) for "
                        f"{idle_timeout_s:.0f} s\n{self.output_tail()}"
                    )
        finally:
            self.kill()

    def output_tail(self, chars: int = 4000) -> str:
        return "\n".join(path.read_text(errors="replace")[-chars:] for path in self.paths)

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by the live processes of its session (and the children they reaped)."""
        return _session_cpu_seconds(self.process.pid)

    def _progress(self) -> tuple[tuple[int, ...], float]:
        sizes = tuple(path.stat().st_size if path.exists() else 0 for path in self.paths)
        return sizes, self.cpu_seconds()

    def kill(self) -> None:
        """SIGKILL every process of its session (a no-op once they are gone)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def wait_all(processes: dict[str, ChildProcess], idle_timeout_s: float = IDLE_TIMEOUT_S) -> dict[str, int]:
        """The exit code of each of ``processes`` (started together, so their start-ups overlap), by name.

        Each is waited for as :meth:`wait` does; when one fails the test, every other one is killed too.

        Example::

            runs = {name: FitProcess(script, [name], log_path=tmp_path / f"{name}.txt") for name in ("a", "b")}
            assert FitProcess.wait_all(runs) == {"a": 0, "b": 0}
        """
        try:
            return {name: process.wait(idle_timeout_s) for name, process in processes.items()}
        finally:
            for process in processes.values():
                process.kill()


class FitProcess(ChildProcess):
    """A test script (usually one ``fit``) run with this interpreter as a :class:`ChildProcess`.

    Its environment is :func:`subprocess_env`; standard output and error go to ``log_path``.

    Example::

        process = FitProcess(script, ["--out", str(out)], log_path=out / "log.txt")
        assert process.wait() == 0, process.output_tail()
    """

    def __init__(self, script: Path | str, args: list[str], *, log_path: Path, cwd: Path | None = None) -> None:
        self.script, self.args, self.log_path = Path(script), list(args), Path(log_path)
        super().__init__([sys.executable, str(script), *self.args], stdout_path=log_path, cwd=cwd)


def run_process(
    command: Sequence[str],
    *,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` as a :class:`ChildProcess`.

    Returns the exit code and both outputs as text. ``env`` defaults to :func:`subprocess_env`.
    """
    with tempfile.TemporaryDirectory(prefix="deepep_lightning_run_") as directory:
        out, err = Path(directory) / "stdout", Path(directory) / "stderr"
        process = ChildProcess(command, stdout_path=out, stderr_path=err, cwd=cwd or os.getcwd(), env=env)
        code = process.wait(idle_timeout_s)
        return subprocess.CompletedProcess(
            process.command, code, out.read_text(errors="replace"), err.read_text(errors="replace")
        )


@pytest.fixture
def cuda_kernels():
    """Skip without CUDA and the compiled kernels; restore deterministic mode afterwards."""
    from deepep_lightning.ops import cuda_kernels_available

    if not torch.cuda.is_available() or not cuda_kernels_available():
        pytest.skip("needs CUDA and the compiled CUDA kernels")
    was = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was)


@pytest.fixture(scope="session")
def boring_module() -> type[BoringModule]:
    return BoringModule


@pytest.fixture(scope="session", name="quiet_trainer")
def _quiet_trainer_fixture():
    return quiet_trainer


@pytest.fixture(scope="session")
def fit_process() -> type[FitProcess]:
    return FitProcess


@pytest.fixture(scope="session", name="run_process")
def _run_process_fixture():
    return run_process


@pytest.fixture(scope="session")
def child_process() -> type[ChildProcess]:
    return ChildProcess
