"""deepep_lightning::fixed_point_scatter_add (extensions/csrc/fixed_point_scatter.cpp): segment_scatter_add's
result with each output element's sum exact in 64-bit fixed point, rounded once and added to base once.

CPU: within one rounding of the exact (float64) sum, along every dimension, int32 and int64 indices, any alpha;
reordering the entries leaves every bit while PyTorch's float index_add_ changes (the negative control); an
element no term reached keeps base's bits (a negative zero included); non-finite terms give a float sum's NaN or
infinity; row chunks (forced by a large output) cover every row; opcheck; float64 refused by name. GPU (marked):
the CUDA kernel gives the CPU kernel's bits, repeats them, agrees with PyTorch's atomic index_add_ to rounding
and runs inside CUDA-graph capture.
"""

import pytest
import torch

from deepep_lightning.ops import extension_available, scatter  # noqa: F401 - scatter registers the op's fake

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")


def op(*args):
    return torch.ops.deepep_lightning.fixed_point_scatter_add.default(*args)


def _case(shape=(7, 500, 5), size=30, dim=1, dtype=torch.float32, seed=0, spread=10, index_dtype=torch.int64):
    generator = torch.Generator().manual_seed(seed)
    src = torch.randn(shape, generator=generator, dtype=torch.float64)
    src = (src * torch.exp2(torch.randint(-spread, spread, shape, generator=generator).double())).to(dtype)
    index = torch.randint(0, size, (shape[dim],), generator=generator).to(index_dtype)
    base_shape = list(shape)
    base_shape[dim] = size
    base = torch.randn(base_shape, generator=generator, dtype=torch.float64).to(dtype)
    return src, index, size, dim, base


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alpha", [1.0, -0.75])
def test_equals_the_exact_sum_rounded(dim, dtype, alpha):
    spread = 10 if dtype == torch.float32 else 3
    src, index, size, dim, base = _case(shape=(6, 40, 9), size=11, dim=dim, dtype=dtype, spread=spread)
    exact = base.double().index_add(dim, index, src.double(), alpha=alpha)
    ours = op(src, index, size, dim, base, alpha)
    assert ours.dtype == dtype
    eps = torch.finfo(dtype).eps  # two roundings (sum and base + sum) for 16 bits, one for float32
    error = (ours.double() - exact).abs()
    assert (error <= eps * exact.abs() + torch.finfo(dtype).tiny).all(), error.max()


def test_reordering_the_entries_leaves_every_bit_where_float_index_add_changes():
    src, index, size, dim, base = _case()
    order = torch.randperm(index.shape[0], generator=torch.Generator().manual_seed(1))
    assert torch.equal(op(src, index, size, dim, base, 1.0), op(src[:, order], index[order], size, dim, base, 1.0))
    # negative control: PyTorch's CPU index_add_ sums in entry order, and its float32 bits follow the order
    assert not torch.equal(base.index_add(dim, index, src), base.index_add(dim, index[order], src[:, order]))


def test_an_untouched_element_keeps_base_bits_and_index_dtypes_agree():
    base = torch.full((4, 3), -0.0)
    out = op(torch.tensor([[1.0, -1.0, 2.0], [-1.0, 1.0, 3.0]]), torch.tensor([1, 1]), 4, 0, base, 1.0)
    assert torch.signbit(out[[0, 2, 3]]).all()  # no term: -0.0 kept (a float sum would give +0.0)
    assert torch.signbit(out[1, :2]).all()  # terms summing to an exact zero: base kept too
    assert out[1, 2].item() == 5.0
    src, index, size, dim, base = _case()
    assert torch.equal(op(src, index, size, dim, base, 1.0), op(src, index.int(), size, dim, base, 1.0))
    assert torch.equal(op(src, index, size, dim, None, 1.0), op(src, index, size, dim, torch.zeros_like(base), 1.0))


def test_non_finite_terms_give_what_a_float_sum_gives():
    src, index, size, dim, base = _case(shape=(2, 60, 4), size=5)
    flat = src.view(-1)
    flat[0], flat[1], flat[9], flat[100] = float("nan"), float("inf"), float("-inf"), float("inf")
    ours, exact = op(src, index, size, dim, base, 1.0), base.double().index_add(dim, index, src.double())
    assert ours.isnan().any() and ours.isinf().any()
    assert torch.equal(ours.isnan(), exact.isnan())
    assert torch.equal(ours.isposinf(), exact.isposinf()) and torch.equal(ours.isneginf(), exact.isneginf())


def test_row_chunks_cover_every_row():
    # 600k rows of 8: the sums take 43 MB beside a 19 MB output, so the rows go in chunks of 16 MiB / 72 B
    src, index, size, dim, base = _case(shape=(20000, 8), size=600_000, dim=0, spread=4)
    exact = base.double().index_add(dim, index, src.double())
    torch.testing.assert_close(op(src, index, size, dim, base, 1.0).double(), exact, rtol=2e-7, atol=1e-9)


def test_opcheck_and_a_float64_source_refused_by_name():
    src, index, size, dim, base = _case(shape=(3, 20, 2), size=6)
    args = (src, index, size, dim, base, 1.0)
    torch.library.opcheck(torch.ops.deepep_lightning.fixed_point_scatter_add.default, args)
    with pytest.raises(RuntimeError, match="fixed_point_scatter_add: src must be float32, float16 or bfloat16"):
        op(src.double(), index, size, dim, base.double(), 1.0)


@pytest.mark.parametrize(
    "shape, size, dim",
    [((7, 500, 5), 30, 1), ((200_000, 16), 1000, 0), ((50_000, 64), 10_000, 0), ((4, 4096), 169, 1), ((3, 1), 1, 0)],
    ids=["middle_dim", "hot_rows", "gnn_like", "bias_table", "one_element"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_gives_the_cpu_bits_and_pytorch_to_rounding(shape, size, dim, dtype):
    src, index, size, dim, base = _case(shape=shape, size=size, dim=dim, dtype=dtype, spread=3)
    on_cpu = op(src, index, size, dim, base, 1.0)
    args = (src.cuda(), index.cuda(), size, dim, base.cuda(), 1.0)
    first = op(*args)
    assert torch.equal(first.cpu(), on_cpu)
    for _ in range(19):
        assert torch.equal(op(*args), first)
    atomic = base.cuda().float().index_add(dim, index.cuda(), src.cuda().float())
    torch.testing.assert_close(first.float(), atomic, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_runs_inside_cuda_graph_capture():
    src, index, size, dim, base = (t.cuda() if isinstance(t, torch.Tensor) else t for t in _case())
    eager = op(src, index, size, dim, base, 1.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(src, index, size, dim, base, 1.0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(src, index, size, dim, base, 1.0)
    graph.replay()
    assert torch.equal(captured, eager)
