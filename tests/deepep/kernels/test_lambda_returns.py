"""deepep::lambda_returns: bit for bit the reference's op-by-op recursion, on CPU and CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from deepep_lightning.deepep.kernels.lambda_returns import lambda_returns, lambda_returns_reference
from deepep_lightning.ops import extension_available

# (gamma, lam): the DeepEP defaults, the two ends of λ, and a discount of 1
COEFFICIENTS = [(0.99, 0.95), (0.9, 0.0), (0.97, 1.0), (1.0, 0.5)]


def make_inputs(horizon=9, batch=6, dtype=torch.float32, seed=0, device="cpu"):
    """rewards, dones (about a third terminal), values, bootstrap_value: values of a few magnitudes."""
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(horizon, batch, generator=generator, dtype=dtype)
    dones = torch.rand(horizon, batch, generator=generator) < 0.3
    values = torch.randn(horizon, batch, generator=generator, dtype=dtype) * 50
    bootstrap = torch.randn(batch, generator=generator, dtype=dtype) * 50
    return [t.to(device) for t in (rewards, dones, values, bootstrap)]


def test_the_compiled_kernel_is_registered():
    assert extension_available()
    assert hasattr(torch.ops.deepep, "lambda_returns")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gamma,lam", COEFFICIENTS)
@pytest.mark.parametrize("shape", [(1, 1), (37, 129), (256, 5)])
def test_kernel_equals_the_reference_bitwise(dtype, gamma, lam, shape):
    inputs = make_inputs(*shape, dtype=dtype, seed=sum(shape))
    got = torch.ops.deepep.lambda_returns.default(*inputs, gamma, lam)
    want = lambda_returns_reference(*inputs, gamma, lam)
    assert got.dtype == dtype and got.shape == shape
    assert torch.equal(got, want), (got - want).abs().max()


def test_bitwise_comparison_tells_a_reordered_recursion_apart():
    """Negative control: the same recursion with γ distributed over the blend (exact in real numbers) differs."""
    rewards, dones, values, bootstrap = make_inputs(256, 64, seed=3)
    gamma, lam = 0.99, 0.95
    kernel = torch.ops.deepep.lambda_returns.default(rewards, dones, values, bootstrap, gamma, lam)
    not_done = (~dones).float()
    next_values = torch.cat((values[1:], bootstrap.unsqueeze(0)))
    reordered, running = torch.empty_like(rewards), bootstrap
    for t in range(rewards.shape[0] - 1, -1, -1):
        blend = (gamma * (1.0 - lam)) * next_values[t] + (gamma * lam) * running
        running = rewards[t] + not_done[t] * blend
        reordered[t] = running
    torch.testing.assert_close(kernel, reordered)  # the same returns to rounding ...
    assert not torch.equal(kernel, reordered)  # ... but not the same bits


def test_the_hand_recursion_and_terminals():
    rewards = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)
    dones = torch.tensor([[False], [True], [False]])
    values = torch.tensor([[0.5], [0.25], [4.0]], dtype=torch.float64)
    bootstrap = torch.tensor([10.0], dtype=torch.float64)
    gamma, lam = 0.9, 0.7
    g2 = 3.0 + gamma * ((1 - lam) * 10.0 + lam * 10.0)
    g1 = 2.0  # the episode ended at t=1: nothing after it counts
    g0 = 1.0 + gamma * ((1 - lam) * 0.25 + lam * g1)
    out = lambda_returns(rewards, dones, values, bootstrap, gamma, lam)
    torch.testing.assert_close(out[:, 0], torch.tensor([g0, g1, g2], dtype=torch.float64), rtol=0, atol=1e-15)


def test_the_result_does_not_depend_on_the_thread_count():
    inputs = make_inputs(64, 1000, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.deepep.lambda_returns.default(*inputs, 0.99, 0.95)
        torch.set_num_threads(max(2, threads))
        many = torch.ops.deepep.lambda_returns.default(*inputs, 0.99, 0.95)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_inputs_that_need_gradients_take_the_differentiable_reference():
    rewards, dones, values, bootstrap = make_inputs(5, 3, dtype=torch.float64)
    values.requires_grad_()
    returns = lambda_returns(rewards, dones, values, bootstrap, 0.9, 0.8)
    (grad,) = torch.autograd.grad(returns.sum(), values)
    assert grad.abs().sum() > 0
    with torch.no_grad():  # the same inputs without gradients run the kernel, with the same bits
        assert torch.equal(lambda_returns(rewards, dones, values, bootstrap, 0.9, 0.8), returns.detach())


def test_opcheck_and_torch_compile():
    opcheck(torch.ops.deepep.lambda_returns.default, (*make_inputs(7, 3), 0.99, 0.95))
    opcheck(torch.ops.deepep.lambda_returns.default, (*make_inputs(4, 2, dtype=torch.float64), 0.9, 1.0))
    inputs = make_inputs(12, 5, seed=6)
    compiled = torch.compile(lambda_returns, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(*inputs, 0.99, 0.95), lambda_returns(*inputs, 0.99, 0.95))


@pytest.mark.parametrize(
    "index,bad,pattern,error",
    [
        (0, torch.zeros(9, dtype=torch.float32), r"rewards must be 2-D \[T, B\]", ValueError),
        (0, torch.zeros(9, 6, dtype=torch.int64), r"rewards must be a floating-point tensor", TypeError),
        (1, torch.zeros(9, 6), r"dones must be a bool tensor", TypeError),
        (1, torch.zeros(9, 5, dtype=torch.bool), r"dones must have shape \(9, 6\)", ValueError),
        (2, torch.zeros(9, 6, dtype=torch.float64), r"values must have rewards' dtype torch.float32", TypeError),
        (3, torch.zeros(9), r"bootstrap_value must have shape \(6,\)", ValueError),
        (3, torch.zeros(6, device="meta"), r"bootstrap_value must be on rewards' device cpu", ValueError),
        (2, [[0.0] * 6] * 9, r"values must be a torch.Tensor, got list", TypeError),
        (4, 1.5, r"`lambda_returns\(gamma=...\)` must be a number in \[0, 1\], got 1.5", ValueError),
        (5, True, r"`lambda_returns\(lam=...\)` must be a number in \[0, 1\], got True", ValueError),
    ],
)
def test_bad_arguments_are_refused_by_name(index, bad, pattern, error):
    arguments = [*make_inputs(), 0.99, 0.95]
    arguments[index] = bad
    with pytest.raises(error, match=pattern):
        lambda_returns(*arguments)


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_kernel_equals_the_cuda_and_cpu_references_bitwise(cuda_kernels, dtype):
    for gamma, lam in COEFFICIENTS:
        for shape in ((256, 256), (3, 1000), (1, 1)):
            cpu = make_inputs(*shape, dtype=dtype, seed=shape[0])
            inputs = [t.cuda() for t in cpu]
            first = torch.ops.deepep.lambda_returns.default(*inputs, gamma, lam)
            again = lambda_returns(*inputs, gamma, lam)
            assert torch.equal(first, again)
            assert torch.equal(first, lambda_returns_reference(*inputs, gamma, lam))
            assert torch.equal(first.cpu(), lambda_returns_reference(*cpu, gamma, lam))


@pytest.mark.gpu
def test_cuda_kernel_runs_on_the_current_stream_inside_a_cuda_graph(cuda_kernels):
    inputs = [t.cuda() for t in make_inputs(64, 300, seed=8)]
    eager = lambda_returns(*inputs, 0.99, 0.95)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lambda_returns(*inputs, 0.99, 0.95)  # warm-up, as graph capture wants
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lambda_returns(*inputs, 0.99, 0.95)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
