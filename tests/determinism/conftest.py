"""Keep process-global determinism settings from leaking out of these tests into other suites."""

from __future__ import annotations

import os

import pytest
import torch

import deepep_lightning.determinism.configuration as configure_module

_ENV = (
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


@pytest.fixture(autouse=True)
def _restore_global_determinism_settings():
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        configure_module._last_record,
        {name: os.environ.get(name) for name in _ENV},
        torch.get_rng_state(),
    )
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.utils.deterministic.fill_uninitialized_memory = saved[2]
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[3], saved[4]
    configure_module._last_record = saved[5]
    for name, value in saved[6].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    torch.set_rng_state(saved[7])
