"""Tests for ``deepep_lightning/determinism/configuration.py``."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from deepep_lightning.determinism.configuration import NCCL_DETERMINISTIC_ENV, configure, last_configure_record


def test_sets_env_flags_and_seeds_and_records_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    torch.use_deterministic_algorithms(False)
    record = configure(11)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["PYTHONHASHSEED"] == "11"
    assert record.env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark
    assert torch.utils.deterministic.fill_uninitialized_memory is False
    assert record.too_late == () and not record.cuda_initialized_before
    assert last_configure_record() is record
    first = torch.rand(3)
    configure(11)
    assert torch.equal(torch.rand(3), first)
    configure(12)
    assert not torch.equal(torch.rand(3), first), "negative control: another seed, another stream"


def test_keeps_a_value_the_user_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert configure(0).env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_distributed_sets_the_nccl_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NCCL_DETERMINISTIC_ENV:
        monkeypatch.delenv(name, raising=False)
    record = configure(0, distributed=True)
    assert all(os.environ[name] == value for name, value in NCCL_DETERMINISTIC_ENV.items())
    assert set(NCCL_DETERMINISTIC_ENV) <= set(record.env)


def test_after_cuda_started_reports_what_is_too_late(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    import deepep_lightning.determinism.configuration as configure_module

    monkeypatch.setattr(configure_module, "_cuda_memory_in_use", lambda: False)
    record = configure(0)  # a context that holds no memory has run no cuBLAS call: still in time
    assert record.cuda_initialized_before and record.too_late == ()
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(configure_module, "_last_record", None)
    monkeypatch.setattr(configure_module, "_cuda_memory_in_use", lambda: True)
    record = configure(0)
    assert record.cuda_initialized_before and "CUBLAS_WORKSPACE_CONFIG" in record.too_late


@pytest.mark.parametrize(
    ("kwargs", "name", "shown"),
    [
        ({"seed": -1}, "seed", "-1"),
        ({"seed": "7"}, "seed", "'7'"),
        ({"cublas_workspace_config": ":8:8"}, "cublas_workspace_config", "':8:8'"),
        ({"warn_only": "yes"}, "warn_only", "'yes'"),
        ({"fill_uninitialized_memory": 1}, "fill_uninitialized_memory", "1"),
    ],
)
def test_bad_arguments_name_argument_and_value(kwargs: dict, name: str, shown: str) -> None:
    with pytest.raises(MisconfigurationException, match=f"`{name}`.*{shown}"):
        configure(**kwargs)


def test_a_second_call_updates_what_configure_set_but_never_a_users_export(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    configure(1)
    record = configure(2)
    assert os.environ["PYTHONHASHSEED"] == "2" and "PYTHONHASHSEED" in record.set_by_configure
    assert "CUBLAS_WORKSPACE_CONFIG" in record.set_by_configure  # still releasable
    monkeypatch.setenv("PL_GLOBAL_SEED", "99")
    import deepep_lightning.determinism.configuration as configure_module

    monkeypatch.setattr(configure_module, "_last_record", None)
    configure(3)
    assert os.environ["PL_GLOBAL_SEED"] == "99"
