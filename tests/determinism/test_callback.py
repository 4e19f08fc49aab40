"""In-process tests for ``deepep_lightning/determinism/callback.py`` (the resumes are in test_resume.py)."""

from __future__ import annotations

import io
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.determinism import DeterminismCallback, FingerprintMismatchError
from deepep_lightning.determinism.fingerprint import collect_fingerprint, diff_fingerprints


def _fit(
    quiet_trainer, module_class, callback: DeterminismCallback | None, validate: bool, tmp_path=None
) -> list[float]:
    torch.manual_seed(0)
    model = module_class(dropout=0.5)
    trainer = quiet_trainer(
        max_steps=6,
        val_check_interval=2,
        limit_val_batches=2 if validate else 0,
        num_sanity_val_steps=2 if validate else 0,
        callbacks=[callback] if callback else [],
        default_root_dir=tmp_path,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    return model.losses


@pytest.mark.parametrize("reseed_every_step", [True, False])
def test_validation_and_sanity_check_do_not_shift_the_training_stream(
    reseed_every_step: bool, boring_module, quiet_trainer
) -> None:
    def run(validate: bool) -> list[float]:
        return _fit(quiet_trainer, boring_module, DeterminismCallback(5, reseed_every_step=reseed_every_step), validate)

    assert run(validate=True) == run(validate=False)


def test_negative_control_without_isolation_validation_shifts_the_stream(boring_module, quiet_trainer) -> None:
    def run(validate: bool) -> list[float]:
        return _fit(
            quiet_trainer,
            boring_module,
            DeterminismCallback(5, reseed_every_step=False, isolate_evaluation=False),
            validate,
        )

    assert run(validate=True) != run(validate=False)


def test_fingerprint_mismatch_raises_in_strict_mode_naming_the_field() -> None:
    callback = DeterminismCallback(3)
    state = callback.state_dict()
    state["fingerprint"]["torch"] = "0.0.1"
    state["fingerprint"]["env.CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    with pytest.raises(
        FingerprintMismatchError,
        match=r"torch: '0\.0\.1' -> .*env\.CUBLAS_WORKSPACE_CONFIG|"
        r"env\.CUBLAS_WORKSPACE_CONFIG.*torch: '0\.0\.1'",
    ):
        callback.load_state_dict(state)
    lenient = DeterminismCallback(3, strict=False)
    with pytest.warns(UserWarning, match="torch"):
        lenient.load_state_dict(state)


def test_fingerprint_mismatch_is_detected_on_a_real_resume(tmp_path, boring_module, quiet_trainer) -> None:
    model = boring_module(dropout=0.5)
    trainer = quiet_trainer(
        max_steps=2,
        limit_val_batches=0,
        callbacks=[DeterminismCallback(3)],
    )
    trainer.fit(model)
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["callbacks"]["DeterminismCallback"]["fingerprint"]["world_size"] = "8"
    checkpoint["callbacks"]["DeterminismCallback"].pop("digest")  # an edit on purpose, not a corruption
    torch.save(checkpoint, path)
    resumed = quiet_trainer(
        max_steps=4,
        limit_val_batches=0,
        callbacks=[DeterminismCallback(3)],
    )
    with pytest.raises(FingerprintMismatchError, match="world_size: '8' -> '1'"):
        resumed.fit(boring_module(dropout=0.5), ckpt_path=path)


def test_a_fit_that_raises_leaves_the_process_as_it_found_it(boring_module, quiet_trainer) -> None:
    """Lightning skips ``teardown`` when fit raises; the callback's ``on_exception`` undoes its setup there."""
    import torch.nn.functional as F

    from deepep_lightning.ops import patch_refused_ops, refused_ops_patched

    seen: list[bool] = []

    class Failing(boring_module):
        def training_step(self, batch, batch_idx):
            seen.append(refused_ops_patched())
            raise RuntimeError("planted failure")

    was_on = patch_refused_ops(False)  # configure() (other tests) installs the routes for the process's life
    interpolate = F.interpolate
    try:
        trainer = quiet_trainer(max_steps=2, limit_val_batches=0, callbacks=[DeterminismCallback(3)])
        with pytest.raises(RuntimeError, match="planted failure"):
            trainer.fit(Failing(dropout=0.5))
        assert seen == [True]  # the routes were on while fit ran
        assert not refused_ops_patched()
        assert F.interpolate is interpolate  # the Python entry a route replaces is back too
    finally:
        patch_refused_ops(was_on)


def test_same_stack_has_no_differences_and_old_checkpoints_load() -> None:
    assert diff_fingerprints(collect_fingerprint(), collect_fingerprint()) == {}
    callback = DeterminismCallback(3)
    callback.load_state_dict({})  # written before this callback existed: nothing to restore, no error
    callback.load_state_dict({"seed": 3, "version": 0})


def test_state_key_and_state_dict_round_trip_restore_the_rng_streams() -> None:
    saver = DeterminismCallback(3, reseed_every_step=False)
    assert saver.state_key == "DeterminismCallback"  # the key its state has under checkpoint["callbacks"]
    torch.manual_seed(11)
    state = saver.state_dict()
    expected = torch.rand(5)
    state = torch.load(_round_trip(state), weights_only=True)  # plain values: loads under weights_only
    assert state["seed"] == 3 and state["reseed_every_step"] is False

    torch.manual_seed(12)  # the resumed process starts elsewhere
    before = torch.rand(5)
    resumed = DeterminismCallback(3, reseed_every_step=False)
    assert resumed.state_key == saver.state_key
    resumed.load_state_dict(state)
    resumed.on_train_batch_start(SimpleNamespace(current_epoch=0), None, None, 0)  # type: ignore[arg-type]
    assert torch.equal(torch.rand(5), expected)  # the stream continues where the state was taken
    assert not torch.equal(before, expected)  # negative control: without the state, other numbers


def _round_trip(state: dict) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_seed_mismatch_on_resume_is_refused() -> None:
    state = DeterminismCallback(3).state_dict()
    with pytest.raises(MisconfigurationException, match="seed=3"):
        DeterminismCallback(4).load_state_dict(state)


def test_strict_setup_raises_when_cuda_started_before_configure(monkeypatch: pytest.MonkeyPatch, boring_module) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    import deepep_lightning.determinism.configuration as configure_module

    monkeypatch.setattr(configure_module, "_last_record", None)
    monkeypatch.setattr(configure_module, "_cuda_memory_in_use", lambda: False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    # negative control: a context that holds no memory yet (Trainer's set_device) ran no cuBLAS call
    DeterminismCallback(1).setup(trainer, boring_module(), "fit")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(configure_module, "_last_record", None)
    monkeypatch.setattr(configure_module, "_cuda_memory_in_use", lambda: True)
    callback = DeterminismCallback(1)  # CUDA "in use": too late for the cuBLAS setting
    with pytest.raises(MisconfigurationException, match="HINT: call `deepep_lightning.configure"):
        callback.setup(trainer, boring_module(), "fit")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(configure_module, "_last_record", None)
    with pytest.warns(UserWarning, match="CUBLAS_WORKSPACE_CONFIG"):
        DeterminismCallback(2, strict=False).setup(trainer, boring_module(), "fit")


@pytest.mark.parametrize(
    ("kwargs", "name", "shown"),
    [
        ({"seed": -3}, "seed", "-3"),
        ({"seed": 1.5}, "seed", "1.5"),
        ({"strict": "no"}, "strict", "'no'"),
        ({"reseed_every_step": None}, "reseed_every_step", "None"),
        ({"cublas_workspace_config": ":1:1"}, "cublas_workspace_config", "':1:1'"),
    ],
)
def test_bad_arguments_name_argument_and_value(kwargs: dict, name: str, shown: str) -> None:
    with pytest.raises(MisconfigurationException, match=f"`{name}`.*{shown}"):
        DeterminismCallback(**kwargs)


def test_strict_refuses_a_loader_it_cannot_make_seekable() -> None:
    class CustomSampler(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(range(8))

        def __len__(self):
            return 8

    loader = torch.utils.data.DataLoader(torch.zeros(8, 4), sampler=CustomSampler(), batch_size=4)
    with pytest.raises(MisconfigurationException, match="CustomSampler"):
        DeterminismCallback(0)._make_seekable(loader)
    with pytest.warns(UserWarning, match="CustomSampler"):
        assert DeterminismCallback(0, strict=False)._make_seekable(loader) is loader


class _Recorder(pl.LightningModule):
    def __init__(self, sampler: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.sampler = sampler
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch.flatten().tolist()))
        return self.layer(batch.float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.arange(16)[:, None]
        if self.sampler == "distributed":  # what Lightning itself injects under DDP
            sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
            return torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, num_workers=2)


def _fit_epochs(quiet_trainer, max_epochs: int, sampler: str, with_callback: bool, ckpt=None):
    model = _Recorder(sampler)
    trainer = quiet_trainer(
        max_epochs=max_epochs,
        callbacks=[DeterminismCallback(0)] if with_callback else [],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, ckpt_path=ckpt)
    return model, trainer


@pytest.mark.parametrize(
    ("sampler", "with_callback", "equal"),
    [("shuffle", True, True), ("distributed", False, False)],
    ids=["seekable_loader", "negative_control_lightning_distributed_sampler"],
)
def test_resume_at_epoch_boundary_with_workers_keeps_the_epoch_order(
    tmp_path, sampler, with_callback, equal, quiet_trainer
) -> None:
    """Lightning 2.6 creates the first iterator after a resume before ``set_epoch``: with workers, a
    ``DistributedSampler`` then prefetches epoch 0's order for epoch 1. The seekable loader is lazy."""
    full, _ = _fit_epochs(quiet_trainer, 2, sampler, with_callback)
    _, first = _fit_epochs(quiet_trainer, 1, sampler, with_callback)
    first.save_checkpoint(tmp_path / "epoch0.ckpt")
    resumed, _ = _fit_epochs(quiet_trainer, 2, sampler, with_callback, ckpt=tmp_path / "epoch0.ckpt")
    assert ([s for s in full.seen if s[0] == 1] == resumed.seen) is equal


@pytest.mark.parametrize("reseed_every_step", [True, False])
def test_sample_loading_restores_the_global_rng_only_without_the_per_step_reseed(reseed_every_step: bool) -> None:
    """With the reseed before every batch the fork of the global RNGs around a batch's loading is work the reseed
    undoes, so the callback's loaders skip it; without the reseed they keep it (the training stream must not move)."""
    loader = torch.utils.data.DataLoader(torch.zeros(8, 4), batch_size=4, shuffle=True)
    seekable = DeterminismCallback(0, reseed_every_step=reseed_every_step)._make_seekable(loader)
    assert seekable.dataset.restore_global_rng is (not reseed_every_step)
