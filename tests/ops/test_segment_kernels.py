"""Tests of the kernels ``deepep_lightning::segment_reduce`` and ``deepep_lightning::histc_counts`` (ops/segments.py,
ops/histograms.py), against their pure-PyTorch references.

CPU: the compiled op equals the reference (exactly for integers, maxima, minima and counts; products to
rounding, and exactly PyTorch's sequential product), every dtype, empty rows and inputs, a hot key, NaN,
bins at and past the edges; the op's own argument errors. GPU (marked): the CUDA kernel is bitwise the CPU
kernel (same element code, same order), repeats bitwise, and is captured in a CUDA graph. Run there:
``python -m pytest tests/ops/test_segment_kernels.py -q``.
"""

import pytest
import torch

from deepep_lightning.ops import extension_available
from deepep_lightning.ops.histograms import histc, histc_counts_reference
from deepep_lightning.ops.segments import segment_reduce, segment_reduce_reference

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8]


def _entries(n, inner, size, dtype, seed=0, hot=False):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, size, (n,), generator=generator)
    if hot:
        keys[: n // 2] = size // 2  # half the entries on one key
    if dtype.is_floating_point:
        values = (torch.rand(n, *inner, generator=generator, dtype=torch.float64) + 0.5).to(dtype)
    else:
        values = torch.randint(-3, 4, (n, *inner), generator=generator).to(dtype)
    return values, keys


def _sequential(values, keys, size, reduce):
    """PyTorch's own sequential CPU kernel: index_reduce with include_self=False, rows without entries 0/1."""
    empty = torch.full((size, *values.shape[1:]), int(reduce == "prod"), dtype=values.dtype)
    return empty.index_reduce(0, keys, values, reduce, include_self=False)


@pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", ["prod", "amax", "amin"])
@pytest.mark.parametrize("shape", [(200, (), 17, False), (300, (3, 4), 40, False), (500, (5,), 9, True)])
def test_segment_reduce_kernel_is_pytorchs_sequential_reduction(dtype, reduce, shape):
    n, inner, size, hot = shape
    values, keys = _entries(n, inner, size, dtype, hot=hot)
    reduced, counts = segment_reduce(values, keys, size, reduce)
    assert torch.equal(counts, torch.bincount(keys, minlength=size))
    assert torch.equal(reduced, _sequential(values, keys, size, reduce))  # same order: bitwise, products too
    reference, reference_counts = segment_reduce_reference(values, keys, size, reduce)
    assert torch.equal(counts, reference_counts)
    if reduce == "prod" and dtype.is_floating_point:  # the scan pairs the operands otherwise: rounding apart
        rtol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-5}.get(dtype, 1e-12)
        torch.testing.assert_close(reduced, reference, rtol=rtol, atol=torch.finfo(dtype).tiny)  # underflow
    else:
        assert torch.equal(reduced, reference)


def test_segment_reduce_kernel_empty_rows_nan_and_signed_zeros():
    nan = float("nan")
    values = torch.tensor([nan, 2.0, 5.0, -0.0, 0.0, 3.0])
    keys = torch.tensor([0, 0, 1, 2, 2, 4])
    maxima, counts = segment_reduce(values, keys, 6, "amax")
    assert counts.tolist() == [2, 1, 2, 0, 1, 0]
    assert torch.isnan(maxima[0]) and maxima[[1, 3, 4, 5]].tolist() == [5.0, 0.0, 3.0, 0.0]
    assert torch.signbit(maxima[2])  # ties keep the first entry (-0.0), as torch.maximum
    products, _ = segment_reduce(values, keys, 6, "prod")
    assert products[[3, 5]].tolist() == [1.0, 1.0]  # rows without entries: the product's identity
    none, counts = segment_reduce(torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64), 3, "amin")
    assert torch.equal(none, torch.zeros(3, 2)) and counts.tolist() == [0, 0, 0]


def test_without_the_kernels_the_references_run(monkeypatch):
    from deepep_lightning.ops import histograms as histograms_module
    from deepep_lightning.ops import segments as segments_module

    values, keys = _entries(300, (2,), 20, torch.float64)
    samples = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    kernel = segment_reduce(values, keys, 20, "amax")[0], histc(samples, 12, -1.0, 1.0)
    calls = []
    original = torch.ops.deepep_lightning.segment_reduce.default

    def spy(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(torch.ops.deepep_lightning.segment_reduce, "default", spy)
    segment_reduce(values, keys, 20, "amax")
    assert len(calls) == 1  # negative control: with the kernels, the op runs
    for module in (segments_module, histograms_module):
        monkeypatch.setattr(module, "kernels_reason", lambda tensor: "no extension here")
    fallback = segment_reduce(values, keys, 20, "amax")[0], histc(samples, 12, -1.0, 1.0)
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(fallback, kernel))


def test_segment_reduce_op_refuses_bad_arguments():
    op = torch.ops.deepep_lightning.segment_reduce.default
    values, keys = torch.ones(4, 2), torch.tensor([0, 2, 2, 1])
    with pytest.raises(RuntimeError, match="reduce must be 'prod', 'amax', 'amin' or 'mean', got 'sum'"):
        op(values, keys, 3, "sum")
    with pytest.raises(RuntimeError, match="values must be 2-D"):
        op(torch.ones(4), keys, 3, "prod")
    with pytest.raises(RuntimeError, match="keys must be \\[4\\]"):
        op(values, keys[:3], 3, "prod")
    with pytest.raises(RuntimeError, match="keys must be int64 or int32"):
        op(values, keys.double(), 3, "prod")
    with pytest.raises(RuntimeError, match="size must be >= 0"):
        op(values, keys, -1, "prod")
    with pytest.raises(RuntimeError, match="base must be \\[3, 2\\]"):
        op(values, keys, 3, "prod", torch.ones(3, 3))
    with pytest.raises(RuntimeError, match="base must have values' dtype"):
        op(values, keys, 3, "prod", torch.ones(3, 2, dtype=torch.float64))
    for bad in (torch.tensor([0, 3, 1, 1]), torch.tensor([0, -1, 1, 1])):  # the sorted keys' two ends
        with pytest.raises(RuntimeError, match="index out of range \\[0, 3\\)"):
            op(values, bad, 3, "prod")
    with pytest.raises(RuntimeError, match="index out of range \\[0, 0\\)"):
        op(values, keys, 0, "amax")  # keys into an empty output
    with pytest.raises(ValueError, match="reduce must be one of"):
        segment_reduce(values, keys, 4, "sum")


def test_segment_reduce_opcheck():
    """Schema, fake (meta) function and dispatch of the op agree (torch.library.opcheck)."""
    values, keys = _entries(60, (3,), 10, torch.float32, seed=2)
    base = torch.rand(10, 3, generator=torch.Generator().manual_seed(3))
    op = torch.ops.deepep_lightning.segment_reduce.default
    torch.library.opcheck(op, (values, keys, 10, "prod"))
    torch.library.opcheck(op, (values, keys.int(), 10, "amax", base, False))
    torch.library.opcheck(op, (values[:0], keys[:0], 10, "amin", base, True))


@pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int8])
@pytest.mark.parametrize("reduce", ["prod", "amax", "amin", "mean"])
@pytest.mark.parametrize("include_base", [True, False])
def test_segment_reduce_op_combines_the_base_as_pytorchs_index_reduce(dtype, reduce, include_base):
    """With ``base``, the op is PyTorch's sequential ``index_reduce`` along dim 0 (``include_self``), bitwise;
    rows without entries keep the base, and an int8 mean's 300-entry sum and count wrap as PyTorch's do. Means of
    float16/bfloat16 sum in float (on these entries: the float64 mean rounded once). Without ``base`` the op
    differs (negative control)."""
    values, keys = _entries(600, (3,), 30, dtype, seed=7, hot=True)
    base = _entries(30, (3,), 1, dtype, seed=8)[0]
    base[5] = 0 if reduce == "prod" else base[5]  # keys 5.. hit; a zero base row, a row without entries
    keys[keys == 11] = 12
    out, counts = torch.ops.deepep_lightning.segment_reduce.default(values, keys, 30, reduce, base, include_base)
    expected = base.index_reduce(0, keys, values, reduce, include_self=include_base)
    assert torch.equal(counts, torch.bincount(keys, minlength=30))
    if reduce == "mean" and dtype in (torch.float16, torch.bfloat16):  # summed in float, by the exact count
        exact = base.double().index_reduce(0, keys, values.double(), "mean", include_self=include_base).to(dtype)
        torch.testing.assert_close(out, exact, rtol=0, atol=0)
        assert not torch.equal(out, expected) or dtype == torch.float16  # PyTorch's bfloat16 mean is off here
    else:
        assert torch.equal(out, expected)
    assert torch.equal(out[11], base[11])  # no entries: the base row
    without_base, _ = torch.ops.deepep_lightning.segment_reduce.default(values, keys, 30, reduce)
    assert not torch.equal(without_base, expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bins, low, high", [(10, -1.0, 1.0), (7, 0.0, 0.5), (1, -2.0, 2.0), (9000, -3.0, 3.0)])
def test_histc_counts_kernel_equals_the_reference_and_pytorch(dtype, bins, low, high):
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(5000, generator=generator, dtype=torch.float64).to(dtype)
    values[:4] = torch.tensor([low, high, float("nan"), high + 1.0], dtype=torch.float64).to(dtype)  # edges
    counts = torch.ops.deepep_lightning.histc_counts.default(values, bins, low, high)
    assert counts.dtype == torch.int64 and torch.equal(counts, histc_counts_reference(values, bins, low, high))
    if dtype in (torch.float64, torch.float32):  # PyTorch's CPU histc takes these
        assert torch.equal(histc(values, bins, low, high), torch.histc(values, bins, low, high))


def test_histc_counts_op_refuses_bad_arguments():
    op = torch.ops.deepep_lightning.histc_counts.default
    with pytest.raises(RuntimeError, match="self must be floating point"):
        op(torch.ones(3, dtype=torch.int64), 4, 0.0, 1.0)
    with pytest.raises(RuntimeError, match="bins must be > 0"):
        op(torch.ones(3), 0, 0.0, 1.0)
    with pytest.raises(RuntimeError, match="low < high"):
        op(torch.ones(3), 4, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="finite"):
        op(torch.ones(3), 4, 0.0, float("inf"))
    assert torch.equal(op(torch.ones(0), 3, 0.0, 1.0), torch.zeros(3, dtype=torch.int64))


# ---- GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduce", ["prod", "amax", "amin", "mean"])
def test_segment_reduce_cuda_is_bitwise_the_cpu_kernel(dtype, reduce):
    for n, inner, size, hot in [(100_000, (), 10_000, False), (20_000, (64,), 1000, True), (7, (3,), 50, False)]:
        values, keys = _entries(n, inner, size, dtype, seed=n, hot=hot)
        flat, op = values.reshape(n, -1), torch.ops.deepep_lightning.segment_reduce.default
        cpu, cpu_counts = op(flat, keys, size, reduce)
        cuda, cuda_counts = op(flat.cuda(), keys.cuda(), size, reduce)
        assert torch.equal(cuda_counts.cpu(), cpu_counts)
        assert torch.equal(cuda.cpu(), cpu)  # same element code, same order
        for _ in range(5):
            assert torch.equal(op(flat.cuda(), keys.cuda(), size, reduce)[0], cuda)
        base = _entries(size, inner, 1, dtype, seed=n + 1)[0].reshape(size, -1)
        for include_base in (True, False):  # the base combined in the same launch
            on_cpu = torch.ops.deepep_lightning.segment_reduce.default(
                flat, keys.int(), size, reduce, base, include_base
            )
            on_gpu = torch.ops.deepep_lightning.segment_reduce.default(
                flat.cuda(), keys.int().cuda(), size, reduce, base.cuda(), include_base
            )
            assert all(torch.equal(g.cpu(), c) for g, c in zip(on_gpu, on_cpu))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bins", [1, 100, 8192, 8193, 100_000])  # shared-memory counts up to 8192 bins
def test_histc_counts_cuda_equals_the_cpu_kernel(dtype, bins):
    generator = torch.Generator().manual_seed(bins)
    values = torch.randn(1_000_003, generator=generator, dtype=torch.float64).to(dtype)
    values[:5] = torch.tensor([-4.0, 4.0, float("nan"), -4.5, 4.5], dtype=torch.float64).to(dtype)
    in_range = int(((values >= -4.0) & (values <= 4.0)).sum())  # NaN and values outside [min, max] are not counted
    cpu = torch.ops.deepep_lightning.histc_counts.default(values, bins, -4.0, 4.0)
    cuda = torch.ops.deepep_lightning.histc_counts.default(values.cuda(), bins, -4.0, 4.0)
    assert torch.equal(cuda.cpu(), cpu) and int(cpu.sum()) == in_range


@pytest.mark.gpu
def test_segment_kernels_are_captured_in_a_cuda_graph():
    values, keys = _entries(4096, (8,), 300, torch.float32)
    values, keys = values.cuda(), keys.cuda()
    samples = torch.randn(10_000, device="cuda")
    eager = (
        segment_reduce(values, keys, 300, "prod")[0],
        torch.ops.deepep_lightning.histc_counts.default(samples, 50, -2, 2),
    )
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture
        segment_reduce(values, keys, 300, "prod")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = (
            segment_reduce(values, keys, 300, "prod")[0],
            torch.ops.deepep_lightning.histc_counts.default(samples, 50, -2.0, 2.0),
        )
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))
