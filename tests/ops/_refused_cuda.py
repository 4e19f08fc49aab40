"""Plain helpers of the GPU tests of the refused-ops kernels (the fixtures are in conftest.py)."""

import torch


def _grid_inputs(shape, seed=0, dtype=torch.float32):
    n, c, h, w, ho, wo, low, high = shape
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype, generator=generator).requires_grad_()
    grid = torch.rand(n, ho, wo, 2, device="cuda", dtype=dtype, generator=generator) * (high - low) + low
    return x, grid.requires_grad_()


def _assert_close_relative(actual, expected, rtol=1e-5):
    scale = expected.abs().max().clamp_min(1e-30)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale.item())


def _atomic_backward(fn, leaves, grad_output):
    """PyTorch's own (atomic) backward of ``fn`` on detached copies of ``leaves``, outside deterministic mode."""
    copies = tuple(leaf.detach().clone().requires_grad_() for leaf in leaves)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        return torch.autograd.grad(fn(*copies), copies, grad_output)
    finally:
        torch.use_deterministic_algorithms(was)
