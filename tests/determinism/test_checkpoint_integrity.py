"""Checkpoint digests, unreadable checkpoint files and plugin-less checkpoints (``checkpoint_integrity.py``)."""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from deepep_lightning.determinism import DeterminismCallback
from deepep_lightning.determinism.checkpoint_integrity import CheckpointIntegrityError, digest


def _train_and_save(tmp_path: Path, quiet_trainer, boring_module, callbacks: list) -> tuple[Path, type]:
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(boring_module())
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    return path, boring_module


def _resume(quiet_trainer, boring_module, path: Path) -> None:
    trainer = quiet_trainer(max_steps=4, limit_val_batches=0, callbacks=[DeterminismCallback(3)])
    trainer.fit(boring_module(), ckpt_path=path)


def _flip_a_bit_of(path: Path, tensor: torch.Tensor) -> None:
    """Flip one bit inside ``tensor``'s bytes in the file itself (the zip reader does not check them)."""
    data = bytearray(path.read_bytes())
    offset = bytes(data).find(tensor.numpy().tobytes())
    assert offset >= 0, "the tensor's bytes are stored verbatim"
    data[offset + 1] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_bit_flip_in_the_weights_is_refused_naming_the_file(tmp_path: Path, quiet_trainer, boring_module) -> None:
    path, module = _train_and_save(tmp_path, quiet_trainer, boring_module, [DeterminismCallback(3)])
    intact = tmp_path / "intact.ckpt"
    shutil.copy(path, intact)
    checkpoint = torch.load(path, weights_only=True)
    assert set(checkpoint["callbacks"]["DeterminismCallback"]["digest"]) == {"state", "model"}
    _flip_a_bit_of(path, checkpoint["state_dict"]["net.0.weight"])
    assert torch.load(path, weights_only=True)["global_step"] == 2  # torch loads the corrupt file silently
    with pytest.raises(CheckpointIntegrityError, match=r"run\.ckpt.*corrupt: the model's state_dict"):
        _resume(quiet_trainer, module, path)
    _resume(quiet_trainer, module, intact)  # negative control: the untouched copy resumes


def test_a_changed_callback_state_is_refused(tmp_path: Path, quiet_trainer, boring_module) -> None:
    path, module = _train_and_save(tmp_path, quiet_trainer, boring_module, [DeterminismCallback(3)])
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["callbacks"]["DeterminismCallback"]["rng"]["torch"][100] ^= 1
    torch.save(checkpoint, path)
    with pytest.raises(CheckpointIntegrityError, match=r"run\.ckpt.*the DeterminismCallback state"):
        _resume(quiet_trainer, module, path)


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "is empty (0 bytes)"),
        ("truncated", "is truncated"),
        (b"garbage, not a checkpoint" * 40, "is not a torch checkpoint"),
    ],
    ids=["zero_bytes", "truncated", "garbage"],
)
def test_an_unreadable_checkpoint_file_is_named(
    tmp_path: Path, quiet_trainer, boring_module, content: bytes | str, said: str
) -> None:
    path, module = _train_and_save(tmp_path, quiet_trainer, boring_module, [DeterminismCallback(3)])
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2] if content == "truncated" else content)  # type: ignore[arg-type]
    with pytest.raises(
        CheckpointIntegrityError, match=re.compile(rf"{re.escape(repr(str(bad)))} .*{re.escape(said)}.*HINT", re.DOTALL)
    ):
        _resume(quiet_trainer, module, bad)


def test_negative_control_without_the_callback_torch_gives_its_own_message(
    tmp_path: Path, quiet_trainer, boring_module
) -> None:
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"")
    trainer = quiet_trainer(max_steps=4, limit_val_batches=0)
    with pytest.raises(Exception) as raised:
        trainer.fit(boring_module(), ckpt_path=bad)
    assert not isinstance(raised.value, CheckpointIntegrityError)


def test_a_checkpoint_written_without_the_plugin_warns_on_resume(tmp_path: Path, quiet_trainer, boring_module) -> None:
    plain, module = _train_and_save(tmp_path, quiet_trainer, boring_module, [])
    with pytest.warns(UserWarning, match=r"run\.ckpt' holds no DeterminismCallback state.*not bitwise"):
        _resume(quiet_trainer, module, plain)
    with_plugin = tmp_path / "plugin"
    with_plugin.mkdir()
    path, _ = _train_and_save(with_plugin, quiet_trainer, boring_module, [DeterminismCallback(3)])
    with warnings.catch_warnings(record=True) as caught:  # negative control: the plugin's own checkpoint
        warnings.simplefilter("always")
        _resume(quiet_trainer, module, path)
    assert not [w for w in caught if "holds no DeterminismCallback state" in str(w.message)]


def test_the_digest_depends_on_content_only() -> None:
    value = {"b": [1, 2.5, None, "x"], "a": torch.arange(4, dtype=torch.float32)}
    assert digest(value) == digest({"a": torch.arange(4, dtype=torch.float32), "b": [1, 2.5, None, "x"]})
    assert digest(value) != digest({**value, "a": torch.arange(4, dtype=torch.float64)})  # dtype counts
    assert digest(value) != digest({**value, "b": [1, 2.5, None, "y"]})
    flipped = torch.arange(4, dtype=torch.float32)
    flipped.view(torch.int32)[2] ^= 1
    assert digest(value) != digest({**value, "a": flipped})
    assert digest({"o": object()}) == digest({"o": object()})  # an address in a repr is not content
