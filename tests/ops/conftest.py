"""Fixtures of the GPU tests of the refused-ops kernels (tests/ops/test_*_cuda.py, test_refused_*_gpu.py).

``cuda_kernels`` is in tests/conftest.py: the DeepEP kernels' tests (tests/deepep/kernels) use it too.
"""

import pytest
import torch


@pytest.fixture
def deterministic_routing(cuda_kernels):
    """CUDA + kernels (``cuda_kernels``), deterministic mode and the dispatcher routing on; both restored afterwards."""
    from deepep_lightning.ops import refused_ops_routing

    torch.use_deterministic_algorithms(True)
    with refused_ops_routing():
        yield
