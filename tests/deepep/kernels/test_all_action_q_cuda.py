"""GPU tests of deepep_lightning/deepep/kernels/all_action_q.py: the CUDA kernels (run by the lead on the H200)."""

import os
import sys
from pathlib import Path

import pytest
import torch

from deepep_lightning.deepep.kernels import all_action_q, all_action_q_reference
from deepep_lightning.ops import cuda_kernels_available, extension_error

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[3]
NAMES = ["q", "dz", "dE", "dw", "db"]


def cuda_inputs(n, a, h, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(n, h, generator=gen, dtype=dtype),
        torch.randn(a, h, generator=gen, dtype=dtype),
        torch.randn(h, generator=gen, dtype=dtype) / h**0.5,
        torch.randn(1, generator=gen, dtype=dtype),
    ]
    grad_q = torch.randn(n, a, generator=gen, dtype=dtype)
    return [t.cuda().requires_grad_() for t in tensors], grad_q.cuda()


def fwd_bwd(fn, inputs, grad_q, **kwargs):
    q = fn(*inputs, **kwargs)
    return (q.detach(), *torch.autograd.grad(q, inputs, grad_q))


@pytest.fixture(scope="module", autouse=True)
def cuda_kernels_built():
    assert cuda_kernels_available(), extension_error() or "built without the CUDA kernels (nvcc not found?)"
    assert torch._C._dispatch_has_kernel_for_dispatch_key("deepep::all_action_q", "CUDA")


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize(
    "shape",
    [(4096, 8, 256), (1000, 18, 128), (333, 33, 100), (257, 3, 300), (50, 2, 20)],
    ids=["target-like", "A18-H128", "A33-odd-H", "generic-H300", "small"],
)
def test_matches_float64_reference_in_fp32(shape, deterministic):
    inputs, grad_q = cuda_inputs(*shape, seed=sum(shape))
    got = fwd_bwd(all_action_q, inputs, grad_q, deterministic=deterministic)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    want = fwd_bwd(all_action_q_reference, inputs64, grad_q.double())
    for name, x, y in zip(NAMES, got, want):
        assert x.dtype == torch.float32 and x.shape == y.shape, name
        rel_err = ((x.double() - y).abs().max() / y.abs().max()).item()
        assert rel_err < 1e-5, f"{name}: relative error {rel_err:.3g}"


@pytest.mark.parametrize("shape", [(700, 5, 96), (1, 1, 1), (65, 33, 300), (20, 30, 512)])
def test_float64_kernels_match_reference(shape):
    # (1, 1, 1): one element, no averaging; (20, 30, 512): the backward halves its block to fit
    # 2 * A doubles per thread in shared memory.
    inputs, grad_q = cuda_inputs(*shape, dtype=torch.float64)
    for deterministic in (True, False):
        got = fwd_bwd(all_action_q, inputs, grad_q, deterministic=deterministic)
        want = fwd_bwd(all_action_q_reference, inputs, grad_q)
        for name, x, y in zip(NAMES, got, want):
            torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-11, msg=name)


def test_deterministic_variant_is_bitwise_equal_over_100_calls():
    inputs, grad_q = cuda_inputs(16384, 8, 256)
    first = fwd_bwd(all_action_q, inputs, grad_q)
    for call in range(100):
        again = fwd_bwd(all_action_q, inputs, grad_q)
        for name, x, y in zip(NAMES, first, again):
            assert torch.equal(x, y), f"{name} differs at call {call}"


def test_negative_control_atomic_variant_is_not_bitwise_stable():
    # Proves the bitwise check above can fail: float atomics reorder the 1024 block partials.
    inputs, grad_q = cuda_inputs(65536, 8, 256)
    first = fwd_bwd(all_action_q, inputs, grad_q, deterministic=False)
    differs = any(
        not torch.equal(first[2], fwd_bwd(all_action_q, inputs, grad_q, deterministic=False)[2]) for _ in range(20)
    )
    assert differs, "20 atomic runs were bitwise equal: the determinism test would not catch atomics"


def test_atomic_variant_raises_under_deterministic_mode_and_warns_with_warn_only():
    inputs, grad_q = cuda_inputs(256, 4, 64)
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        fwd_bwd(all_action_q, inputs, grad_q)  # negative control: the default variant is allowed
        with pytest.raises(RuntimeError, match=r"all_action_q_backward_cuda.*deterministic=False"):
            fwd_bwd(all_action_q, inputs, grad_q, deterministic=False)
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match=r"all_action_q_backward_cuda.*deterministic=False"):
            fwd_bwd(all_action_q, inputs, grad_q, deterministic=False)
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn)


def test_correct_on_a_non_default_stream():
    inputs, grad_q = cuda_inputs(8192, 8, 256)
    want = fwd_bwd(all_action_q, inputs, grad_q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Keep the side stream busy, then produce the inputs on it: a kernel launched on any
        # other stream would read them before they are written.
        torch.cuda._sleep(50_000_000)
        side_inputs = [t.detach().clone().requires_grad_() for t in inputs]
        side_grad = grad_q.clone()
        got = fwd_bwd(all_action_q, side_inputs, side_grad)
    torch.cuda.current_stream().wait_stream(side)
    for name, x, y in zip(NAMES, got, want):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("deterministic", [True, False])
def test_capturable_in_a_cuda_graph(deterministic):
    inputs, grad_q = cuda_inputs(4096, 8, 128)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fwd_bwd(all_action_q, inputs, grad_q, deterministic=deterministic)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fwd_bwd(all_action_q, inputs, grad_q, deterministic=deterministic)
    new_inputs, new_grad = cuda_inputs(4096, 8, 128, seed=7)
    with torch.no_grad():
        for static, fresh in zip(inputs, new_inputs):
            static.copy_(fresh)
        grad_q.copy_(new_grad)
    graph.replay()
    want = fwd_bwd(all_action_q, inputs, grad_q, deterministic=deterministic)
    for name, x, y in zip(NAMES, captured, want):
        if deterministic:
            assert torch.equal(x, y), name
        else:
            # atomics: the 4096-term fp32 sums of dw/db come in another order on every run
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4, msg=name)


def test_clean_under_torch_cuda_sanitizer(run_process):
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1", PYTHONPATH=str(REPO))
    script = REPO / "benchmarks" / "sanitize_all_action_q.py"
    result = run_process([sys.executable, str(script), "--quick"], env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "CSAN" not in result.stderr and "data race" not in result.stderr.lower(), result.stderr[-3000:]
