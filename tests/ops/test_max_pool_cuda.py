"""GPU tests of the argmax-scatter routes: adaptive / fractional / 3-D max pool backwards, max_unpool, embedding_bag.

Run on the GPU machine: ``python -m pytest tests/ops/test_max_pool_cuda.py -q``.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_kernels")]
aten = torch.ops.aten

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _randn(*shape, dtype, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=generator).to(dtype)


def _samples(batch, channels, dims, seed=1):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(batch, channels, dims, device="cuda", generator=generator)


# Each case: (batch, dtype) -> (aten op call, its CUDA args, autograd function of a leaf, the leaf, batch-sliceable).
def adaptive_max_pool2d(batch, dtype):
    x = _randn(batch, 8, 33, 33, dtype=dtype)
    out, indices = F.adaptive_max_pool2d(x, 7, return_indices=True)  # overlapping adaptive windows
    return (
        aten.adaptive_max_pool2d_backward,
        (_randn(*out.shape, dtype=dtype, seed=2), x, indices),
        (lambda leaf: F.adaptive_max_pool2d(leaf, 7)),
        x,
    )


def adaptive_max_pool2d_channels_last(batch, dtype):
    x = _randn(batch, 16, 20, 24, dtype=dtype).contiguous(memory_format=torch.channels_last)
    out, indices = F.adaptive_max_pool2d(x, (6, 5), return_indices=True)
    return (
        aten.adaptive_max_pool2d_backward,
        (_randn(*out.shape, dtype=dtype, seed=2), x, indices),
        (lambda leaf: F.adaptive_max_pool2d(leaf, (6, 5))),
        x,
    )


def adaptive_max_pool3d(batch, dtype):
    x = _randn(batch, 4, 9, 10, 11, dtype=dtype)
    out, indices = F.adaptive_max_pool3d(x, (4, 5, 3), return_indices=True)
    return (
        aten.adaptive_max_pool3d_backward,
        (_randn(*out.shape, dtype=dtype, seed=2), x, indices),
        (lambda leaf: F.adaptive_max_pool3d(leaf, (4, 5, 3))),
        x,
    )


def max_pool3d(batch, dtype):
    x = _randn(batch, 4, 12, 12, 12, dtype=dtype)
    out, indices = F.max_pool3d(x, 3, stride=2, padding=1, return_indices=True)
    args = ([3, 3, 3], [2, 2, 2], [1, 1, 1], [1, 1, 1], False)

    def call(grad, x, indices):
        return aten.max_pool3d_with_indices_backward(grad, x, *args, indices)

    return (
        call,
        (_randn(*out.shape, dtype=dtype, seed=2), x, indices),
        (lambda leaf: F.max_pool3d(leaf, 3, stride=2, padding=1)),
        x,
    )


def max_pool3d_dilated_ceil(batch, dtype):
    x = _randn(batch, 3, 9, 11, 10, dtype=dtype)
    out, indices = F.max_pool3d(x, 3, stride=2, padding=1, dilation=2, ceil_mode=True, return_indices=True)
    args = ([3, 3, 3], [2, 2, 2], [1, 1, 1], [2, 2, 2], True)

    def call(grad, x, indices):
        return aten.max_pool3d_with_indices_backward(grad, x, *args, indices)

    return (
        call,
        (_randn(*out.shape, dtype=dtype, seed=2), x, indices),
        (lambda leaf: F.max_pool3d(leaf, 3, stride=2, padding=1, dilation=2, ceil_mode=True)),
        x,
    )


def fractional_max_pool2d(batch, dtype):
    x = _randn(batch, 4, 20, 20, dtype=dtype)
    samples = _samples(batch, 4, 2).to(dtype)
    out, indices = F.fractional_max_pool2d(x, 3, output_size=8, return_indices=True, _random_samples=samples)

    def call(grad, x, indices):
        return aten.fractional_max_pool2d_backward(grad, x, [3, 3], [8, 8], indices)

    return (
        call,
        (_randn(*out.shape, dtype=dtype, seed=2), x, indices),
        (lambda leaf: F.fractional_max_pool2d(leaf, 3, output_size=8, _random_samples=samples)),
        x,
    )


def fractional_max_pool3d(batch, dtype):
    x = _randn(batch, 3, 10, 10, 10, dtype=dtype)
    samples = _samples(batch, 3, 3).to(dtype)
    out, indices = F.fractional_max_pool3d(x, 2, output_size=4, return_indices=True, _random_samples=samples)

    def call(grad, x, indices):
        return aten.fractional_max_pool3d_backward(grad, x, [2, 2, 2], [4, 4, 4], indices)

    return (
        call,
        (_randn(*out.shape, dtype=dtype, seed=2), x, indices),
        (lambda leaf: F.fractional_max_pool3d(leaf, 2, output_size=4, _random_samples=samples)),
        x,
    )


def max_unpool2d(batch, dtype):
    x = _randn(batch, 4, 16, 16, dtype=dtype)
    out, indices = F.max_pool2d(x, 3, stride=1, return_indices=True)  # duplicate indices (same values)
    pooled = out.detach().clone().requires_grad_()

    def call(values, indices):
        return aten.max_unpool2d(values, indices, [16, 16])

    return call, (out, indices), (lambda leaf: F.max_unpool2d(leaf, indices, 3, stride=1, output_size=[16, 16])), pooled


def max_unpool3d(batch, dtype):
    x = _randn(batch, 2, 8, 8, 8, dtype=dtype)
    out, indices = F.max_pool3d(x, 2, return_indices=True)
    pooled = out.detach().clone().requires_grad_()

    def call(values, indices):
        return aten.max_unpool3d(values, indices, [8, 8, 8], [2, 2, 2], [0, 0, 0])

    return call, (out, indices), (lambda leaf: F.max_unpool3d(leaf, indices, 2)), pooled


def embedding_bag_max(batch, dtype):
    weight = _randn(100, 16, dtype=dtype)
    generator = torch.Generator(device="cuda").manual_seed(3)
    indices = torch.randint(0, 100, (50 * batch,), device="cuda", generator=generator)
    offsets = torch.arange(0, 50 * batch, 5, device="cuda")
    offsets[3] = offsets[2]  # an empty bag: max index -1, adds nothing
    out, offset2bag, bag_size, max_indices = aten._embedding_bag(
        weight, indices, offsets, False, 2, False, None, False, 7
    )

    def call(grad, max_indices):
        if not grad.is_cuda:  # the oracle, CUDA's convention: empty bags (-1) and padding_idx add nothing
            rows = max_indices.reshape(-1)
            keep = (rows >= 0) & (rows != 7)
            columns = torch.arange(grad.shape[1]).repeat(grad.shape[0])
            flat = torch.zeros(100 * grad.shape[1], dtype=grad.dtype)
            flat.index_add_(0, (rows * grad.shape[1] + columns)[keep], grad.reshape(-1)[keep])
            return flat.view(100, grad.shape[1])
        return aten._embedding_bag_dense_backward(
            grad, indices, offset2bag, bag_size, max_indices, 100, False, 2, None, 7
        )

    leaf = weight.detach().clone().requires_grad_()
    return (
        call,
        (_randn(*out.shape, dtype=dtype, seed=2), max_indices),
        (lambda w: F.embedding_bag(indices, w, offsets, mode="max", padding_idx=7)),
        leaf,
    )


CASES = {
    f.__name__: f
    for f in (
        adaptive_max_pool2d,
        adaptive_max_pool2d_channels_last,
        adaptive_max_pool3d,
        max_pool3d,
        max_pool3d_dilated_ceil,
        fractional_max_pool2d,
        fractional_max_pool3d,
        max_unpool2d,
        max_unpool3d,
        embedding_bag_max,
    )
}
BATCH_SLICEABLE = set(CASES) - {"embedding_bag_max"}


def _cpu64(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double() if value.is_floating_point() else value.cpu()
    return value


def _autograd_result(fn, leaf):
    leaf = leaf.detach().clone().requires_grad_()
    out = fn(leaf)
    grad_output = torch.ones_like(out) if out.dim() == 0 else _randn(*out.shape, dtype=out.dtype, seed=9)
    (grad,) = torch.autograd.grad(out, leaf, grad_output)
    return out.detach(), grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_oracle_and_pytorch_and_repeats_bitwise(name, dtype, deterministic_routing):
    call, args, _, _ = CASES[name](2, dtype)
    ours = call(*args)
    for _ in range(20):
        assert torch.equal(call(*args), ours)
    torch.use_deterministic_algorithms(False)  # PyTorch's CPU max_unpool alerts too; its serial loop is the oracle
    oracle = call(*[_cpu64(a) for a in args])
    torch.use_deterministic_algorithms(True)
    scale = oracle.abs().max().clamp_min(1e-30).item()
    torch.testing.assert_close(ours.double().cpu(), oracle, rtol=0, atol=4 * RTOL[dtype] * scale)
    torch.use_deterministic_algorithms(False)
    if name == "embedding_bag_max" and dtype == torch.bfloat16:
        # PyTorch's CUDA kernel has no bfloat16 "max" backward; the deterministic kernel has one.
        with pytest.raises(NotImplementedError, match="not implemented for 'BFloat16'"):
            call(*args)
        return
    theirs = call(*args)  # PyTorch's atomic kernel
    torch.testing.assert_close(ours.double().cpu(), theirs.double().cpu(), rtol=0, atol=8 * RTOL[dtype] * scale)
    assert ours.stride() == theirs.stride()


# torch 2.11 runs adaptive_max_pool3d backward in deterministic mode; the route serves it all the same.
REFUSED_BY_PYTORCH = sorted(set(CASES) - {"adaptive_max_pool3d"})


@pytest.mark.parametrize("name", REFUSED_BY_PYTORCH)
def test_pytorch_refuses_without_the_route_and_runs_with_it(name, cuda_kernels):
    from deepep_lightning.ops import refused_ops_routing

    _, _, fn, leaf = CASES[name](2, torch.float32)
    torch.use_deterministic_algorithms(True)
    with refused_ops_routing(False), pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
        _autograd_result(fn, leaf)
    with refused_ops_routing():
        out, grad = _autograd_result(fn, leaf)
        again = _autograd_result(fn, leaf)
    assert torch.equal(again[0], out) and torch.equal(again[1], grad)


@pytest.mark.parametrize("name", sorted(BATCH_SLICEABLE))
def test_a_sample_does_not_depend_on_the_batch(name, deterministic_routing):
    call, args, _, _ = CASES[name](4, torch.float32)
    whole = call(*args)
    alone = call(*[a[:1] if isinstance(a, torch.Tensor) else a for a in args])
    assert torch.equal(alone, whole[:1])


@pytest.mark.parametrize("name", ["adaptive_max_pool2d", "max_pool3d", "fractional_max_pool2d"])
def test_under_torch_compile(name, deterministic_routing):
    _, _, fn, leaf = CASES[name](2, torch.float32)
    eager = _autograd_result(fn, leaf)
    compiled = torch.compile(fn)
    first = _autograd_result(compiled, leaf)
    again = _autograd_result(compiled, leaf)
    assert torch.equal(again[1], first[1])
    torch.testing.assert_close(first[1], eager[1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_in_a_cuda_graph(name, deterministic_routing):
    call, args, _, _ = CASES[name](2, torch.float32)
    eager = call(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("name", ["max_unpool2d", "max_unpool3d"])
def test_max_unpool_under_torch_compile_calls_the_route(name, deterministic_routing):
    """PyTorch's decomposition of max_unpool refuses deterministic mode while tracing; with the routes on the op
    traces with the route's shape function and the compiled graph calls the routed aten op (ops/_tracing.py)."""
    _, _, fn, leaf = CASES[name](2, torch.float32)
    eager = _autograd_result(fn, leaf)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    first = _autograd_result(compiled, leaf)
    again = _autograd_result(compiled, leaf)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(torch.equal(a, b) for a, b in zip(first, eager))  # the same kernels as eager: bitwise


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel,stride", [(2, 2), (3, 2), (3, 1), ((3, 2, 2), 2)])  # 1, 8, 27 (gather), 4 passes
def test_argmax_window_backward_cuda_is_bitwise_the_cpu_kernel(dtype, kernel, stride):
    """The passes of disjoint windows (or the gather, past 8 passes) add each cell's terms in the order the CPU
    kernel does (max_pool_windows.h): the two devices give the same bits."""
    x = _randn(2, 16, 9, 20, 22, dtype=dtype)
    out, indices = F.max_pool3d(x, kernel, stride, padding=1, return_indices=True)
    grad = _randn(*out.shape, dtype=dtype, seed=3)
    triple = [kernel] * 3 if isinstance(kernel, int) else list(kernel)
    args = ([9, 20, 22], triple, [stride] * 3, [1, 1, 1], [1, 1, 1])
    cuda = torch.ops.deepep_lightning.argmax_window_backward(grad, indices, *args)
    cpu = torch.ops.deepep_lightning.argmax_window_backward(grad.cpu(), indices.cpu(), *args)
    assert torch.equal(cuda.cpu(), cpu)
