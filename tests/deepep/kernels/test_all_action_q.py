"""CPU tests of deepep_lightning/deepep/kernels/all_action_q.py: the compiled C++ kernel against the reference."""

import shutil

import pytest
import torch
from torch.library import opcheck

from deepep_lightning.deepep.kernels import all_action_q, all_action_q_reference
from deepep_lightning.ops import extension_available, extension_error


def make_inputs(n=37, a=5, h=11, dtype=torch.float64, seed=0, bias_shape=(1,), requires_grad=True):
    """Fresh random inputs (never zeros), scaled so tanh is neither saturated nor linear."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(n, h, generator=gen, dtype=dtype),
        torch.randn(a, h, generator=gen, dtype=dtype),
        torch.randn(h, generator=gen, dtype=dtype) / h**0.5,
        torch.randn(bias_shape, generator=gen, dtype=dtype),
    ]
    return [t.requires_grad_(requires_grad) for t in tensors]


def grads_of(fn, inputs, grad_q):
    q = fn(*inputs)
    return (q, *torch.autograd.grad(q, inputs, grad_q))


def test_extension_is_built_when_a_compiler_exists():
    # A silent fallback in CI would leave the C++ kernel untested: make it a failure.
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler on this machine")
    assert extension_available(), f"extension did not build: {extension_error()}"
    assert hasattr(torch.ops.deepep, "all_action_q")
    z, e, w, b = make_inputs()
    q = all_action_q(z, e, w, b)
    # The compiled op's autograd node, not the reference's (SumBackward/AddBackward).
    assert "deepep_all_action_q" in q.grad_fn.name()


@pytest.mark.parametrize("bias_shape", [(), (1,)])
@pytest.mark.parametrize("n", [1, 150])  # 150 rows span three 64-row chunks of the CPU reduction
def test_gradcheck_float64(n, bias_shape):
    inputs = make_inputs(n=n, a=3, h=4, bias_shape=bias_shape, seed=n)
    assert torch.autograd.gradcheck(lambda *x: all_action_q(*x), inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("shape", [(37, 5, 11), (1000, 3, 16), (200, 40, 7)])
def test_matches_reference_forward_and_backward(shape, dtype, tol):
    n, a, h = shape
    inputs = make_inputs(n=n, a=a, h=h, dtype=dtype, seed=sum(shape))
    grad_q = torch.randn(n, a, dtype=dtype, generator=torch.Generator().manual_seed(1))
    fused = grads_of(all_action_q, inputs, grad_q)
    reference = grads_of(all_action_q_reference, inputs, grad_q)
    for name, got, want in zip(["q", "dz", "dE", "dw", "db"], fused, reference):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert want.abs().max() > 0, f"{name}: a zero oracle proves nothing"
        rel_err = (got - want).abs().max() / want.abs().max()
        assert rel_err < tol, f"{name}: relative error {rel_err:.3g} >= {tol}"


def test_non_contiguous_inputs_and_partial_requires_grad():
    z, e, w, b = make_inputs(requires_grad=False)
    z_t = z.t().contiguous().t().requires_grad_()  # same values, column-major strides
    e_big = torch.stack([e, e], dim=-1)[..., 0]  # strided view of the same values
    assert not z_t.is_contiguous() and not e_big.is_contiguous()
    q = all_action_q(z_t, e_big, w, b)
    torch.testing.assert_close(q, all_action_q_reference(z, e, w, b), rtol=0, atol=1e-12)
    (dz,) = torch.autograd.grad(q.sum(), [z_t])
    (dz_ref,) = torch.autograd.grad(all_action_q_reference(z.requires_grad_(), e, w, b).sum(), [z])
    torch.testing.assert_close(dz, dz_ref, rtol=0, atol=1e-12)


def test_empty_batch():
    z, e, w, b = make_inputs(n=0)
    q = all_action_q(z, e, w, b)
    assert q.shape == (0, 5)
    dz, de, dw, db = torch.autograd.grad(q.sum(), [z, e, w, b])
    assert dz.shape == (0, 11) and not de.any() and not dw.any() and not db.any()


def _bitwise_run(num_threads, dtype=torch.float32):
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        inputs = make_inputs(n=2000, a=8, h=32, dtype=dtype, seed=3)
        grad_q = torch.randn(2000, 8, dtype=dtype, generator=torch.Generator().manual_seed(4))
        # deterministic=False selects the atomic variant on CUDA only; the CPU kernel ignores it.
        return grads_of(lambda *x: all_action_q(*x, deterministic=False), inputs, grad_q)
    finally:
        torch.set_num_threads(previous)


def test_bitwise_repeat_and_thread_count_independent():
    first = _bitwise_run(1)
    again = _bitwise_run(1)
    two_threads = _bitwise_run(2)
    for name, x, y, y2 in zip(["q", "dz", "dE", "dw", "db"], first, again, two_threads):
        assert torch.equal(x, y), f"{name} differs between two identical calls"
        assert torch.equal(x, y2), f"{name} differs between 1 and 2 threads"
    # Negative control: the check is sensitive to one ulp and the reference's summation order
    # really differs from the kernel's (else the comparison above would be vacuous).
    assert not torch.equal(first[2], torch.nextafter(first[2], torch.full_like(first[2], float("inf"))))
    reference = grads_of(
        all_action_q_reference,
        make_inputs(n=2000, a=8, h=32, dtype=torch.float32, seed=3),
        torch.randn(2000, 8, generator=torch.Generator().manual_seed(4)),
    )
    assert not all(torch.equal(x, r) for x, r in zip(first, reference))


def test_opcheck_forward_and_backward():
    assert extension_available()
    z, e, w, b = make_inputs(n=9, a=3, h=6, dtype=torch.float32)
    opcheck(torch.ops.deepep.all_action_q.default, (z, e, w, b, True))
    opcheck(torch.ops.deepep.all_action_q.default, (z.detach(), e.detach(), w.detach(), b.detach().reshape(()), False))
    grad_q = torch.randn(9, 3)
    opcheck(torch.ops.deepep.all_action_q_backward.default, (grad_q, z.detach(), e.detach(), w.detach(), True))


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    inputs = make_inputs(n=16, a=4, h=8, dtype=torch.float32)
    compiled = torch.compile(all_action_q, fullgraph=True)
    grad_q = torch.randn(16, 4)
    got = grads_of(compiled, inputs, grad_q)
    want = grads_of(all_action_q, inputs, grad_q)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
