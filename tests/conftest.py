"""Shared test setup: small thread pools (CI has 2 cores) and GPU markers that skip cleanly."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)


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
