"""Tests for ``deepep_lightning/determinism/fingerprint.py``."""

from __future__ import annotations

import io

import pytest
import torch

from deepep_lightning.determinism.configuration import configure
from deepep_lightning.determinism.fingerprint import (
    DETERMINISM_ENV_VARS,
    collect_fingerprint,
    diff_fingerprints,
    format_fingerprint,
)


def test_fields_are_plain_strings_and_load_with_weights_only() -> None:
    record = collect_fingerprint(world_size=2)
    assert all(type(value) is str for value in record.values())  # not TorchVersion
    for field in ("torch", "cuda", "cudnn", "nccl", "lightning", "gpu_name", "gpu_count", "driver", "deepep_lightning"):
        assert field in record
    assert record["world_size"] == "2"
    assert all(f"env.{name}" in record for name in DETERMINISM_ENV_VARS)
    buffer = io.BytesIO()
    torch.save(record, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == record


def test_diff_names_changed_fields_only() -> None:
    saved = collect_fingerprint()
    current = dict(saved, torch="9.9", hostname="elsewhere", new_field="x")
    assert diff_fingerprints(saved, current) == {"torch": (saved["torch"], "9.9")}
    assert diff_fingerprints(saved, saved) == {}


def test_flags_and_env_are_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    configure(0, cublas_workspace_config=":16:8")
    record = collect_fingerprint()
    assert record["deterministic_algorithms"] == "True"
    assert record["env.CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")  # released after the first GEMM: still reported as set
    assert collect_fingerprint()["env.CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_markdown_table_for_tensorboard() -> None:
    text = format_fingerprint({"b": "2", "a": "1"})
    assert text.splitlines()[2] == "| a | 1 |"
