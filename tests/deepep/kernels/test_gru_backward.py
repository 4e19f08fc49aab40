"""deepep::gru_cell_backward: the compiled kernels against the reference and a float64 autograd oracle."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from deepep_lightning.deepep.kernels.gru_backward import gru_cell_backward, gru_cell_backward_reference
from deepep_lightning.ops import extension_available


def make_inputs(batch=7, size=5, dtype=torch.float64, seed=0, device="cpu"):
    """grad_output, carry, mask (some rows ended), input_gates, hidden_gates, hidden: never zeros."""
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.arange(batch) % 3 != 1).to(dtype)
    tensors = [
        torch.randn(batch, size, generator=generator, dtype=dtype),
        torch.randn(batch, size, generator=generator, dtype=dtype),
        mask,
        torch.randn(batch, 3 * size, generator=generator, dtype=dtype),
        torch.randn(batch, 3 * size, generator=generator, dtype=dtype),
        torch.randn(batch, size, generator=generator, dtype=dtype),
    ]
    return [t.to(device) for t in tensors]


def autograd_oracle(grad_output, carry, mask, input_gates, hidden_gates, hidden):
    """The same gradients by autograd of the GRU cell's forward formula (torch.nn.GRUCell's, gates [r, z, n])."""
    gi, gh, h = (t.detach().clone().requires_grad_() for t in (input_gates, hidden_gates, hidden))
    gi_r, gi_z, gi_n = gi.chunk(3, dim=-1)
    gh_r, gh_z, gh_n = gh.chunk(3, dim=-1)
    r, z = torch.sigmoid(gi_r + gh_r), torch.sigmoid(gi_z + gh_z)
    n = torch.tanh(gi_n + r * gh_n)
    stored = mask.unsqueeze(-1) * ((1 - z) * n + z * h)
    grad_gi, grad_gh, grad_h = torch.autograd.grad(stored, (gi, gh, h), grad_output + carry)
    # the op's grad_hidden is the blend's part alone; the caller adds grad_hidden_gates @ W_hh
    return grad_gi, grad_gh, grad_h


def test_the_compiled_kernel_is_registered():
    assert extension_available()
    assert hasattr(torch.ops.deepep, "gru_cell_backward")


@pytest.mark.parametrize("shape", [(7, 5), (1, 1), (300, 33)])
def test_kernel_and_reference_equal_the_float64_autograd_oracle(shape):
    inputs = make_inputs(*shape, seed=sum(shape))
    oracle = autograd_oracle(*inputs)
    for name, result in (("kernel", gru_cell_backward(*inputs)), ("reference", gru_cell_backward_reference(*inputs))):
        for got, want in zip(result, oracle):
            assert want.abs().max() > 0
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13, msg=name)


def test_float32_kernel_equals_the_reference_to_rounding():
    inputs = make_inputs(64, 16, dtype=torch.float32, seed=3)
    for got, want in zip(gru_cell_backward(*inputs), gru_cell_backward_reference(*inputs)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_an_ended_row_gets_no_gradient_and_a_wrong_mask_is_caught():
    inputs = make_inputs(6, 4, seed=1)
    grads = gru_cell_backward(*inputs)
    ended = inputs[2] == 0
    assert ended.any() and all(g[ended].abs().max() == 0 for g in grads)
    assert all(g[~ended].abs().min() > 0 for g in grads[:1])
    # negative control: the oracle with every row going on differs exactly on the ended rows
    unmasked = autograd_oracle(*inputs[:2], torch.ones_like(inputs[2]), *inputs[3:])
    assert not torch.allclose(unmasked[0], grads[0])


def test_bitwise_repeat():
    inputs = make_inputs(129, 17, dtype=torch.float32, seed=5)
    first, second = gru_cell_backward(*inputs), gru_cell_backward(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_opcheck():
    opcheck(torch.ops.deepep.gru_cell_backward.default, tuple(make_inputs(5, 3, dtype=torch.float32)))
    opcheck(torch.ops.deepep.gru_cell_backward.default, tuple(make_inputs(4, 2, dtype=torch.float64)))


def test_traced_by_torch_compile():
    inputs = make_inputs(8, 4, dtype=torch.float32, seed=2)
    compiled = torch.compile(gru_cell_backward, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(*inputs), gru_cell_backward(*inputs)):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "index,bad,pattern,error",
    [
        (0, torch.zeros(7, 4, dtype=torch.float64), r"grad_output must have shape \(7, 5\)", ValueError),
        (1, torch.zeros(7, 5, dtype=torch.float32), r"carry must have hidden's dtype torch.float64", TypeError),
        (2, torch.ones(6, dtype=torch.float64), r"mask must have shape \(7,\)", ValueError),
        (3, torch.zeros(7, 5, dtype=torch.float64), r"input_gates must have shape \(7, 15\)", ValueError),
        (
            4,
            torch.zeros(7, 15, dtype=torch.float64, device="meta"),
            r"hidden_gates must be on hidden's device cpu",
            ValueError,
        ),
        (5, torch.zeros(7, 5, dtype=torch.int64), r"hidden must be float32 or float64", TypeError),
        (5, torch.zeros(35, dtype=torch.float64), r"hidden must be 2-D \[B, H\]", ValueError),
        (1, [[0.0] * 5] * 7, r"carry must be a torch.Tensor, got list", TypeError),
    ],
)
def test_bad_arguments_are_refused_by_name(index, bad, pattern, error):
    inputs = make_inputs(7, 5)
    inputs[index] = bad
    with pytest.raises(error, match=pattern):
        gru_cell_backward(*inputs)


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_kernel_equals_the_oracle_and_repeats_bitwise(cuda_kernels):
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        inputs = make_inputs(257, 64, dtype=dtype, seed=9, device="cuda")
        oracle = autograd_oracle(*[t.double() for t in inputs])
        first, second = gru_cell_backward(*inputs), gru_cell_backward(*inputs)
        for got, again, want in zip(first, second, oracle):
            assert torch.equal(got, again)
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_cuda_kernel_runs_on_the_current_stream_inside_a_cuda_graph(cuda_kernels):
    inputs = make_inputs(64, 32, dtype=torch.float32, seed=4, device="cuda")
    eager = gru_cell_backward(*inputs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gru_cell_backward(*inputs)  # warm-up, as graph capture wants
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gru_cell_backward(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))
