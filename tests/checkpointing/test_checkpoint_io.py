"""AtomicCheckpointIO: a failed or killed write never leaves a partial file under the checkpoint's name.

* ``ENOSPC`` injected in the middle of a ``ModelCheckpoint`` save (the write raises after half the
  bytes): :class:`CheckpointWriteError` names the path, the bytes needed and the bytes free; no
  file and no temporary file is left; the older checkpoint resumes.
* ``on_write_error="warn"``: the same failure warns, training goes on, the next save succeeds and
  the older checkpoint is kept until then.
* A real 9 MiB tmpfs (where this machine may mount one; skipped otherwise) holding a 1 MiB
  checkpoint and 3 MiB of other files: a 6 MiB checkpoint does not fit, nothing is left under its
  name and the older one loads. Negative control: Lightning's ``TorchCheckpointIO`` leaves a
  truncated file there (its temporary file is in the system temporary directory, and the commit
  is a copy).
* ``kill -9`` in the middle of a write (a real process rewriting a 32 MiB checkpoint): the file
  under the final name loads. Negative control: ``torch.save`` straight to the path leaves a file
  that does not load.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from deepep_lightning.checkpointing import AtomicCheckpointIO, CheckpointWriteError, atomic_file

_WRITE_LOOP = Path(__file__).with_name("_write_loop.py")


@pytest.fixture
def full_disk_at(monkeypatch: pytest.MonkeyPatch):
    """``full_disk_at("step=4")``: writes of a file whose name contains that text fail half-way with ENOSPC."""

    def install(marker: str, times: int = 1) -> list[str]:
        failed: list[str] = []
        write_all = atomic_file._write_all

        def failing(handle, data):
            if marker in handle.name and len(failed) < times:
                write_all(handle, data[: len(data) // 2])  # a partial temporary file exists when it fails
                failed.append(handle.name)
                raise OSError(errno.ENOSPC, "No space left on device")
            write_all(handle, data)

        monkeypatch.setattr(atomic_file, "_write_all", failing)
        return failed

    return install


def _trainer(quiet_trainer, directory: Path, io: AtomicCheckpointIO, max_steps: int, save_top_k: int = -1):
    checkpoint = ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=save_top_k)
    return quiet_trainer(max_steps=max_steps, callbacks=[checkpoint], plugins=[io], enable_checkpointing=True)


def _names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_enospc_during_a_checkpoint_leaves_no_partial_file_and_the_older_one_resumes(
    tmp_path: Path, quiet_trainer, boring_module, full_disk_at
) -> None:
    failed = full_disk_at("step=4")
    trainer = _trainer(quiet_trainer, tmp_path, AtomicCheckpointIO(), max_steps=6)
    with pytest.raises(CheckpointWriteError) as raised:
        trainer.fit(boring_module())
    assert failed, "the injected failure never ran"
    message = str(raised.value)
    final = str(tmp_path / "epoch=0-step=4.ckpt")
    assert repr(final) in message and "ENOSPC" in message and "previous checkpoint is the newest" in message
    assert re.search(r"needs \d+ bytes .* has \d+ bytes .* free", message), message
    assert _names(tmp_path) == ["epoch=0-step=2.ckpt"]  # no partial file, no temporary file

    resumed = _trainer(quiet_trainer, tmp_path / "resumed", AtomicCheckpointIO(), max_steps=6)
    resumed.fit(boring_module(), ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    assert resumed.global_step == 6


def test_warn_keeps_training_keeps_the_older_checkpoint_and_retries(
    tmp_path: Path, quiet_trainer, boring_module, full_disk_at
) -> None:
    full_disk_at("step=4")
    trainer = _trainer(quiet_trainer, tmp_path, AtomicCheckpointIO(on_write_error="warn"), max_steps=6, save_top_k=1)
    with pytest.warns(UserWarning, match=r"could not write the checkpoint .*step=4.*Training continues"):
        trainer.fit(boring_module())
    assert trainer.global_step == 6
    # step 2 stays until a later save succeeds (save_top_k=1 would have removed it when step 4 "saved")
    assert _names(tmp_path) == ["epoch=0-step=2.ckpt", "epoch=0-step=6.ckpt"]
    assert torch.load(tmp_path / "epoch=0-step=6.ckpt", weights_only=False)["global_step"] == 6


def test_on_write_error_is_checked() -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=r"`on_write_error` must be one of .*'raise'.*got 'ignore'"):
        AtomicCheckpointIO(on_write_error="ignore")  # type: ignore[arg-type]


@pytest.fixture
def small_filesystem(tmp_path: Path):
    """A 9 MiB tmpfs mounted at ``tmp_path / "small"``; the test is skipped where mounting is not allowed."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.strip() or result.returncode}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def _checkpoint(version: int, mib: int) -> dict:
    return {"version": version, "weights": torch.full((mib * 2**18,), float(version))}  # float32: 4 bytes each


@pytest.mark.parametrize("io_class", [AtomicCheckpointIO, TorchCheckpointIO], ids=["atomic", "lightning"])
def test_a_real_full_filesystem(small_filesystem: Path, io_class: type) -> None:
    # 9 MiB: a 1 MiB checkpoint, 3 MiB of other files (snapshots, logs), then a 6 MiB checkpoint that cannot fit
    io = io_class()
    io.save_checkpoint(_checkpoint(1, mib=1), small_filesystem / "epoch=0-step=5.ckpt")
    (small_filesystem / "other").write_bytes(bytes(3 * 2**20))
    new = small_filesystem / "epoch=0-step=10.ckpt"
    with pytest.raises(OSError if io_class is TorchCheckpointIO else CheckpointWriteError) as raised:
        io.save_checkpoint(_checkpoint(2, mib=6), new)
    if io_class is TorchCheckpointIO:  # negative control: Lightning's copy across file systems left a part
        assert new.exists() and 0 < new.stat().st_size
        with pytest.raises(RuntimeError, match="failed reading zip archive"):
            torch.load(new, weights_only=True)
        return
    assert f"{str(new)!r}" in str(raised.value) and "ENOSPC" in str(raised.value)
    assert re.search(r"needs 629\d{4} bytes .* has \d+ bytes .* free", str(raised.value)), raised.value
    assert _names(small_filesystem) == ["epoch=0-step=5.ckpt", "other"]
    assert torch.load(small_filesystem / "epoch=0-step=5.ckpt", weights_only=True)["version"] == 1


def _kill_in_the_middle_of_a_write(fit_process, tmp_path: Path, mode: str) -> Path:
    path = tmp_path / "last.ckpt"
    ready = tmp_path / "last.ckpt.ready"  # holds the size of a complete file
    process = fit_process(_WRITE_LOOP, [str(path), mode], log_path=tmp_path / "log.txt", cwd=tmp_path)
    partial = path.with_name(path.name + f".tmp.{process.process.pid}") if mode == "atomic" else path
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.process.poll() is None:
        if ready.exists():
            complete = int(ready.read_text())
            try:
                size = partial.stat().st_size
            except FileNotFoundError:  # between two writes (the rename took the temporary file)
                size = 0
            if 0 < size < complete * 0.9:  # a write is under way, far from its end
                process.process.kill()
                break
        time.sleep(0.001)
    assert process.wait() == -9, process.output_tail()
    return path


@pytest.mark.slow
def test_kill_9_in_the_middle_of_a_write_leaves_the_previous_checkpoint(tmp_path: Path, fit_process) -> None:
    path = _kill_in_the_middle_of_a_write(fit_process, tmp_path, "atomic")
    checkpoint = torch.load(path, weights_only=True)
    assert torch.equal(checkpoint["weights"], torch.full_like(checkpoint["weights"], checkpoint["version"]))


@pytest.mark.slow
def test_negative_control_a_plain_torch_save_killed_mid_write_does_not_load(tmp_path: Path, fit_process) -> None:
    path = _kill_in_the_middle_of_a_write(fit_process, tmp_path, "plain")
    with pytest.raises(RuntimeError, match="failed reading zip archive"):
        torch.load(path, weights_only=True)
