"""The NCCL profile: set where unset, exported values kept, switch reductions reported."""

from __future__ import annotations

import pytest

from deepep_lightning.determinism.nccl_profile import NCCL_RECORDED_ENV, apply_nccl_profile, nccl_profile


@pytest.fixture
def clean_env(monkeypatch):
    for name in NCCL_RECORDED_ENV + ("NCCL_COLLNET_ENABLE",):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_profile_is_set_before_the_process_group(clean_env):
    recorded, problems = apply_nccl_profile("Ring", "Simple")
    assert problems == []
    assert recorded["NCCL_ALGO"] == "Ring" and recorded["NCCL_PROTO"] == "Simple"
    assert recorded["NCCL_NVLS_ENABLE"] == "0" and recorded["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert recorded["NCCL_MIN_NCHANNELS"] == "<unset>"  # recorded even when nobody set it
    assert set(nccl_profile()) <= set(NCCL_RECORDED_ENV)


def test_exported_values_win_and_are_recorded(clean_env):
    clean_env.setenv("NCCL_ALGO", "Tree")
    recorded, problems = apply_nccl_profile("Ring", "LL")
    assert recorded["NCCL_ALGO"] == "Tree" and recorded["NCCL_PROTO"] == "LL"
    assert problems == []


@pytest.mark.parametrize(
    ("name", "value"),
    [("NCCL_NVLS_ENABLE", "1"), ("NCCL_ALGO", "NVLS"), ("NCCL_ALGO", "Ring,Tree"), ("NCCL_COLLNET_ENABLE", "1")],
)
def test_switch_reductions_are_reported(clean_env, name, value):
    clean_env.setenv(name, value)
    _, problems = apply_nccl_profile()
    assert len(problems) == 1 and name in problems[0]
