"""Fixtures of the GPU tests of the refused-ops kernels (tests/ops/test_*_cuda.py, test_refused_*_gpu.py)."""

import pytest
import torch


@pytest.fixture
def cuda_kernels():
    """Skip without CUDA and the compiled kernels; restore deterministic mode afterwards."""
    from deepep_lightning.ops import cuda_kernels_available

    if not torch.cuda.is_available() or not cuda_kernels_available():
        pytest.skip("needs CUDA and the compiled deepep_lightning CUDA kernels")
    was = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was)


@pytest.fixture
def deterministic_routing(cuda_kernels):
    """CUDA + kernels, deterministic mode and the dispatcher routing on; both restored afterwards."""
    from deepep_lightning.ops import refused_ops_routing

    torch.use_deterministic_algorithms(True)
    with refused_ops_routing():
        yield
