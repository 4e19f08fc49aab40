"""Tests of the deterministic reductions (ops/reductions.py, ops/histograms.py, ops/median.py).

CPU: each implementation against PyTorch's CPU kernel (exact for integers and counts, to rounding for
floats), ``include_self`` both ways, empty and out-of-range inputs, the route wrappers, the route table.
GPU (marked): the routed aten op under deterministic mode does not raise, equals the CPU oracle and
repeats bitwise ×20. Run there: ``python -m pytest tests/ops/test_refused_reductions.py -q``.
"""

import pytest
import torch

from deepep_lightning.ops import _routes, extension_available, routed_aten_ops
from deepep_lightning.ops import histograms as histograms_module
from deepep_lightning.ops import median as median_module
from deepep_lightning.ops import reductions as reductions_module
from deepep_lightning.ops._routes import Route, registered_routes
from deepep_lightning.ops.histograms import bincount, histc
from deepep_lightning.ops.median import median_dim, nanmedian_dim
from deepep_lightning.ops.reductions import index_reduce, put_accumulate, scatter_reduce_prod
from deepep_lightning.ops.segments import segment_reduce

pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")
needs_extension = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")

FLOATS = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
INTEGERS = [torch.int64, torch.int32, torch.int16, torch.uint8]
ROUTED = {
    "index_reduce",
    "index_reduce_",
    "index_reduce.out",
    "scatter_reduce.two",
    "scatter_reduce_.two",
    "scatter_reduce.two_out",
    "put_",
    "median.dim_values",
    "nanmedian.dim_values",
    "histc",
    "histc.out",
    "bincount",
}


def _values(shape, dtype, generator, low=-3, high=4):
    """Small values (near 1 for floats, so products stay in range); integers exact in every dtype."""
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=generator, dtype=torch.float64) + 0.5).to(dtype)
    low = 0 if dtype == torch.uint8 else low
    return torch.randint(low, high, shape, generator=generator).to(dtype)


def _assert_matches(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.is_floating_point():
        rtol = {torch.float16: 5e-3, torch.bfloat16: 4e-2}.get(expected.dtype, 1e-6)  # a few roundings
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=0, equal_nan=True)
    else:
        assert torch.equal(actual, expected)


# ---- index_reduce -------------------------------------------------------------------------------------


@needs_extension
@pytest.mark.parametrize("dtype", FLOATS + INTEGERS)
@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_reduce_matches_pytorch(dtype, reduce, include_self, dim):
    generator = torch.Generator().manual_seed(0)
    self = _values((6, 5, 4), dtype, generator)
    index = torch.randint(0, self.shape[dim], (9,), generator=generator)
    index[0] = index[1]  # at least one row with several entries
    shape = list(self.shape)
    shape[dim] = 9
    source = _values(shape, dtype, generator)
    ours = index_reduce(self, dim, index, source, reduce, include_self)
    theirs = self.index_reduce(dim, index, source, reduce, include_self=include_self)
    _assert_matches(ours, theirs)
    # entries combined from self on in PyTorch's sequential order: the same bits, except the means of float16 and
    # bfloat16, which sum in float here
    if reduce != "mean" or dtype not in (torch.float16, torch.bfloat16):
        assert torch.equal(ours, theirs) and ours.stride() == theirs.stride()
    assert torch.equal(index_reduce(self, dim, index, source, reduce, include_self), ours)  # bitwise repeat


@needs_extension
@pytest.mark.parametrize("reduce", ["prod", "mean", "amax"])
def test_index_reduce_include_self_is_honoured(reduce):
    generator = torch.Generator().manual_seed(1)
    self = _values((5, 3), torch.float64, generator) + 1
    index = torch.tensor([0, 0, 3])
    source = _values((3, 3), torch.float64, generator)
    with_self = index_reduce(self, 0, index, source, reduce, True)
    without = index_reduce(self, 0, index, source, reduce, False)
    # Negative control: the two semantics differ on the reached rows and agree on the others.
    assert not torch.allclose(with_self[[0, 3]], without[[0, 3]])
    assert torch.equal(with_self[[1, 2, 4]], self[[1, 2, 4]]) and torch.equal(without[[1, 2, 4]], self[[1, 2, 4]])
    assert not torch.allclose(without, self.index_reduce(0, index, source, reduce, include_self=True))


@needs_extension
def test_index_reduce_int32_index_non_contiguous_and_empty():
    generator = torch.Generator().manual_seed(2)
    self = _values((4, 6), torch.float64, generator).t()  # non-contiguous [6, 4]
    index = torch.tensor([5, 0, 5, 2], dtype=torch.int32)
    source = _values((4, 4), torch.float64, generator)
    for reduce in ("prod", "mean"):
        _assert_matches(index_reduce(self, 0, index, source, reduce), self.index_reduce(0, index, source, reduce))
        empty = index_reduce(self, 0, index[:0], source[:0], reduce, False)
        assert torch.equal(empty, self)


@needs_extension
def test_index_reduce_integer_products_wrap_as_pytorch():
    self = torch.full((2,), 3, dtype=torch.int64)
    index = torch.zeros(50, dtype=torch.int64)
    source = torch.full((50,), 7, dtype=torch.int64)  # 3 * 7**50 wraps around int64
    assert torch.equal(index_reduce(self, 0, index, source, "prod"), self.index_reduce(0, index, source, "prod"))


@needs_extension
def test_index_reduce_zeros_and_signs_in_products():
    self = torch.tensor([2.0, -1.0, 1.0])
    index = torch.tensor([0, 0, 1, 1, 1, 2])
    source = torch.tensor([0.0, 5.0, -2.0, -3.0, -0.5, float("inf")])
    expected = self.index_reduce(0, index, source, "prod")
    assert torch.equal(index_reduce(self, 0, index, source, "prod"), expected)
    assert torch.equal(expected, torch.tensor([0.0, 3.0, float("inf")]))


@pytest.mark.parametrize("reduce", ["amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce_extrema_propagate_nan_and_keep_signed_zeros(reduce, include_self):
    nan = float("nan")
    self = torch.tensor([1.0, nan, 3.0, -0.0, 0.0])
    index = torch.tensor([0, 0, 1, 2, 2, 3, 4, 4])
    source = torch.tensor([nan, 2.0, 5.0, 1.0, nan, 0.0, -0.0, 0.0])
    ours = index_reduce(self, 0, index, source, reduce, include_self)
    theirs = self.index_reduce(0, index, source, reduce, include_self=include_self)
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs)) and torch.isnan(ours[0])
    assert torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs))


def test_index_reduce_rejects_bad_arguments():
    self, index, source = torch.ones(4, 2), torch.tensor([0, 4]), torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="index out of range"):
        index_reduce(self, 0, index, source, "prod")
    with pytest.raises(RuntimeError, match="index out of range"):
        index_reduce(self, 0, torch.tensor([-1, 0]), source, "mean")
    with pytest.raises(ValueError, match="reduce must be one of"):
        index_reduce(self, 0, torch.tensor([0, 1]), source, "sum")
    with pytest.raises(ValueError, match="dim 2"):
        index_reduce(self, 2, torch.tensor([0, 1]), source, "prod")
    with pytest.raises(ValueError, match="source must have self's dtype"):
        index_reduce(self, 0, torch.tensor([0, 1]), source.double(), "prod")


# ---- scatter_reduce(prod) ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS + INTEGERS)
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_reduce_prod_matches_pytorch(dtype, include_self, dim):
    generator = torch.Generator().manual_seed(3)
    self = _values((5, 6), dtype, generator).t()  # non-contiguous [6, 5]
    index = torch.randint(0, self.shape[dim], (4, 5), generator=generator)  # smaller than src and self
    src = _values((5, 7), dtype, generator)
    ours = scatter_reduce_prod(self, dim, index, src, include_self)
    theirs = self.scatter_reduce(dim, index, src, "prod", include_self=include_self)
    _assert_matches(ours, theirs)
    if dtype not in (torch.float16, torch.bfloat16):  # PyTorch's CPU scatter keeps those in float between entries
        assert torch.equal(ours, theirs)  # from self on, in PyTorch's sequential order: the same bits
    assert torch.equal(scatter_reduce_prod(self, dim, index, src, include_self), ours)


def test_scatter_reduce_prod_include_self_and_empty():
    self = torch.tensor([2.0, 3.0, 5.0])
    index = torch.tensor([0, 0])
    src = torch.tensor([7.0, 11.0])
    assert torch.equal(scatter_reduce_prod(self, 0, index, src, True), torch.tensor([154.0, 3.0, 5.0]))
    assert torch.equal(scatter_reduce_prod(self, 0, index, src, False), torch.tensor([77.0, 3.0, 5.0]))
    assert torch.equal(scatter_reduce_prod(self, 0, index[:0], src[:0], False), self)
    with pytest.raises(RuntimeError, match="index out of range"):
        scatter_reduce_prod(self, 0, torch.tensor([3]), src[:1])
    with pytest.raises(ValueError, match="must not exceed src"):
        scatter_reduce_prod(self, 0, torch.tensor([0, 1, 2]), src)


# ---- put_(accumulate=True) -----------------------------------------------------------------------------


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int64, torch.int32])
def test_put_accumulate_matches_pytorch(dtype, monkeypatch):
    generator = torch.Generator().manual_seed(4)
    self = _values((3, 4), dtype, generator)
    index = torch.randint(-12, 12, (2, 10), generator=generator)  # negative indices count from the end
    source = _values((20,), dtype, generator)
    calls = []
    kernel = torch.ops.deepep_lightning.segment_scatter_add.default
    monkeypatch.setattr(
        torch.ops.deepep_lightning.segment_scatter_add, "default", lambda *a: calls.append(a) or kernel(*a)
    )
    ours = put_accumulate(self, index, source)
    assert len(calls) == int(dtype.is_floating_point)  # floats: the fixed-order kernel; integers: PyTorch's sum
    _assert_matches(ours, self.clone().put_(index, source, accumulate=True))
    assert not torch.equal(ours, self.clone().put_(index, source, accumulate=False))  # negative control
    assert torch.equal(put_accumulate(self, index[:0], source[:0]), self)
    with pytest.raises(RuntimeError, match="index out of range"):
        put_accumulate(self, torch.tensor([12]), source[:1])
    with pytest.raises(ValueError, match="one element per index"):
        put_accumulate(self, index, source[:3])


# ---- bincount(weights) ---------------------------------------------------------------------------------


@needs_extension
@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.float64, torch.float16, torch.int64])
@pytest.mark.parametrize("minlength", [0, 20])
def test_bincount_matches_pytorch(weights_dtype, minlength):
    generator = torch.Generator().manual_seed(5)
    values = torch.randint(0, 9, (200,), generator=generator)
    weights = (torch.randn(200, generator=generator) * 4).to(weights_dtype)
    ours = bincount(values, weights, minlength)
    _assert_matches(ours, torch.bincount(values, weights=weights, minlength=minlength))
    assert torch.equal(bincount(values.to(torch.int16), weights, minlength), ours)
    assert not torch.allclose(ours, torch.bincount(values, minlength=minlength).to(ours.dtype))  # weights matter


def test_bincount_empty_and_bad_inputs():
    weights = torch.ones(0)
    assert torch.equal(bincount(torch.zeros(0, dtype=torch.int64), weights, 3), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="non-negative integral"):
        bincount(torch.tensor([-1, 1]), torch.ones(2))
    with pytest.raises(RuntimeError, match="non-negative integral"):
        bincount(torch.tensor([[1, 1]]), torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="weights must be 1-D"):
        bincount(torch.tensor([1, 1]), torch.ones(3))
    with pytest.raises(ValueError, match="minlength"):
        bincount(torch.tensor([1]), torch.ones(1), -1)


# ---- histc ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("bins", "low", "high"), [(8, 0, 0), (7, -1.0, 1.5), (100, -3, 3), (1, 0, 0)])
def test_histc_matches_pytorch(dtype, bins, low, high):
    generator = torch.Generator().manual_seed(6)
    values = torch.randn(5000, generator=generator).to(dtype).view(50, 100)
    ours = histc(values, bins, low, high)
    assert torch.equal(ours, torch.histc(values, bins, low, high))
    assert torch.equal(histc(values, bins, low, high), ours)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_histc_half_precision_on_values_away_from_the_edges(dtype):
    values = (torch.arange(64) % 16 + 0.25).to(dtype)  # bins of width 1 over [0, 16]: no value near an edge
    assert torch.equal(histc(values, 16, 0, 16), torch.histc(values, 16, 0, 16))


def test_histc_edges_range_and_ignored_values():
    values = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, -1.0, 5.0, float("nan")])
    ours = histc(values, 4, 0, 4)
    assert torch.equal(ours, torch.tensor([1.0, 1.0, 1.0, 2.0]))  # max goes in the last bin; -1, 5, nan ignored
    assert torch.equal(ours, torch.histc(values, 4, 0, 4))
    assert not torch.equal(ours, torch.histc(values, 4, 0, 4.5))  # negative control: another range, other bins
    constant = torch.tensor([2.0, 2.0])
    assert torch.equal(histc(constant, 4), torch.histc(constant, 4))  # min == max of the data: widened by 1
    assert torch.equal(histc(torch.zeros(0), 4), torch.histc(torch.zeros(0), 4))
    assert torch.equal(histc(torch.zeros(0), 4, 1, 2), torch.zeros(4))


def test_histc_errors():
    with pytest.raises(RuntimeError, match="not finite"):
        histc(torch.tensor([1.0, float("inf")]), 4)
    with pytest.raises(RuntimeError, match="max must be larger than min"):
        histc(torch.tensor([1.0, 2.0]), 4, 3, 1)
    with pytest.raises(RuntimeError, match="bins must be > 0"):
        histc(torch.tensor([1.0, 2.0]), 0)
    with pytest.raises(ValueError, match="self must be one of"):
        histc(torch.tensor([1, 2]), 4)


# ---- median(dim) ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS + INTEGERS)
@pytest.mark.parametrize(("dim", "keepdim"), [(0, False), (1, True), (-1, False)])
def test_median_distinct_values_match_pytorch_exactly(dtype, dim, keepdim):
    generator = torch.Generator().manual_seed(7)
    values = torch.randperm(7 * 6, generator=generator).view(7, 6)  # distinct: one correct index
    if dtype == torch.int8 or dtype == torch.uint8:
        values = values % 100
    values = values.to(dtype)
    ours = median_dim(values, dim, keepdim)
    theirs = values.median(dim, keepdim)
    assert torch.equal(ours.values, theirs.values) and torch.equal(ours.indices, theirs.indices)


@pytest.mark.parametrize("length", [1, 2, 5, 6, 9])
def test_median_ties_take_the_stable_rank(length):
    generator = torch.Generator().manual_seed(length)
    values = torch.randint(0, 3, (40, length), generator=generator).double()
    ours = median_dim(values, 1)
    theirs = values.median(1)
    assert torch.equal(ours.values, theirs.values)
    assert torch.equal(values.gather(1, ours.indices[:, None])[:, 0], ours.values)  # the index names a median
    # The documented rule: the (n - 1) // 2-th element of the stable ascending order.
    stable = torch.sort(values, dim=1, stable=True).indices[:, (length - 1) // 2]
    assert torch.equal(ours.indices, stable)
    assert torch.equal(ours.indices, theirs.indices)  # PyTorch's CPU kernel picks the same on these


def test_median_nan_zero_dim_and_empty():
    values = torch.tensor([[1.0, float("nan"), 2.0, float("nan")], [3.0, 1.0, 2.0, 0.0]])
    ours = median_dim(values, 1)
    theirs = values.median(1)
    assert torch.isnan(ours.values[0]) and ours.values[1] == 1.0
    assert torch.equal(ours.indices, theirs.indices) and ours.indices.tolist() == [1, 1]  # the first NaN
    scalar = median_dim(torch.tensor(3.0), -1)
    assert scalar.values.item() == 3.0 and scalar.indices.item() == 0 and scalar.indices.dim() == 0
    with pytest.raises(IndexError, match="Expected reduction dim 1 to have non-zero size"):
        median_dim(torch.zeros(2, 0), 1)
    with pytest.raises(IndexError, match="dim must be in"):
        median_dim(torch.zeros(2, 3), 2)
    with pytest.raises(ValueError, match="self must be one of"):
        median_dim(torch.zeros(2, dtype=torch.bool), 0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
@pytest.mark.parametrize("keepdim", [False, True])
def test_nanmedian_ranks_the_numbers_and_matches_pytorch(dtype, keepdim):
    nan = float("nan")
    generator = torch.Generator().manual_seed(9)
    values = torch.randperm(8 * 7, generator=generator).view(8, 7).to(dtype)
    values[torch.rand(8, 7, generator=generator) < 0.4] = nan
    values[0] = nan  # all NaN: NaN at the first position
    values[1, :3] = torch.tensor([nan, 2.0, 2.0])  # ties among the numbers
    ours = nanmedian_dim(values, 1, keepdim)
    theirs = values.nanmedian(1, keepdim)
    assert torch.equal(ours.values.nan_to_num(-1), theirs.values.nan_to_num(-1))
    # All NaN: the first position (PyTorch's CPU kernel names any one of them); other rows as PyTorch.
    assert ours.indices[0].flatten().tolist() == [0]
    assert torch.equal(ours.indices[1:], theirs.indices[1:])
    assert not torch.equal(ours.values.nan_to_num(-1), median_dim(values, 1, keepdim).values.nan_to_num(-1))


# ---- segment_reduce, route wrappers and the route table --------------------------------------------------


def test_segment_reduce_counts_and_empty_rows():
    products, counts = segment_reduce(torch.tensor([2.0, 3.0, 5.0, 7.0]), torch.tensor([3, 0, 3, 3]), 5)
    assert torch.equal(products, torch.tensor([3.0, 1.0, 1.0, 70.0, 1.0]))
    assert torch.equal(counts, torch.tensor([1, 0, 0, 3, 0]))
    products, counts = segment_reduce(torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64), 2)
    assert torch.equal(products, torch.ones(2, 2)) and torch.equal(counts, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="keys must be 1-D"):
        segment_reduce(torch.ones(3), torch.tensor([0, 1]), 2)
    with pytest.raises(ValueError, match="reduce must be one of"):
        segment_reduce(torch.ones(2), torch.tensor([0, 1]), 2, "sum")
    maxima, _ = segment_reduce(torch.tensor([2.0, 3.0, -5.0]), torch.tensor([1, 1, 0]), 2, "amax")
    assert torch.equal(maxima, torch.tensor([-5.0, 3.0]))


@needs_extension
def test_route_wrappers_write_in_place_and_out():
    generator = torch.Generator().manual_seed(8)
    self = _values((5, 3), torch.float64, generator)
    index = torch.tensor([4, 0, 4])
    source = _values((3, 3), torch.float64, generator)
    expected = self.index_reduce(0, index, source, "mean", include_self=False)
    target = self.clone()
    assert reductions_module._index_reduce_inplace(target, 0, index, source, "mean", include_self=False) is target
    _assert_matches(target, expected)
    out = torch.empty(0, dtype=torch.float64)
    reductions_module._index_reduce_out(self, 0, index, source, "mean", include_self=False, out=out)
    _assert_matches(out, expected)
    scatter_index = index.view(3, 1).expand(3, 3)
    target = self.clone()
    reductions_module._scatter_reduce_inplace(target, 0, scatter_index, source, "prod")
    _assert_matches(target, self.scatter_reduce(0, scatter_index, source, "prod"))
    target = self.clone()
    reductions_module._put(target, index, source[0], True)
    _assert_matches(target, self.clone().put_(index, source[0], accumulate=True))
    out = torch.empty(0)
    histograms_module._histc_out(source.float(), 4, out=out)
    assert torch.equal(out, torch.histc(source.float(), 4))
    values, indices = torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.int64)
    median_module._route(self, 1, True, values=values, indices=indices)
    assert torch.equal(values, self.median(1, True).values) and torch.equal(indices, self.median(1, True).indices)


def test_routes_are_registered_and_leave_other_cases_to_pytorch():
    assert ROUTED <= set(routed_aten_ops())
    routes = registered_routes()
    cpu, index = torch.ones(4, 3), torch.tensor([0, 1])
    assert routes["index_reduce"].covers(cpu, 0, index, torch.ones(2, 3), "prod") is not None  # CPU
    meta = torch.ones(4, 3, device="meta")
    assert "'sum' is left to PyTorch" in routes["index_reduce"].covers(meta, 0, index, meta[:2], "sum")
    assert "CUDA" in routes["index_reduce"].covers(meta, 0, index, meta[:2], "amax")
    assert "'sum'" in routes["scatter_reduce.two"].covers(meta, 0, index.view(2, 1), meta, "sum")
    assert "accumulate=False" in routes["put_"].covers(meta, index, meta[0, :2], False)
    assert "without weights" in routes["bincount"].covers(torch.tensor([1, 2]))
    assert "integer histc" in routes["histc"].covers(torch.tensor([1, 2]))
    assert "CUDA" in routes["median.dim_values"].covers(
        cpu, 0, values=torch.empty(0), indices=torch.empty(0, dtype=torch.int64)
    )


def _dispatcher_calls():
    """aten op -> a call that reaches it through the dispatcher (CPU tensors)."""
    generator = torch.Generator().manual_seed(10)
    self = _values((6, 4), torch.float64, generator)
    index = torch.tensor([5, 0, 5, 2, 5])
    source = _values((5, 4), torch.float64, generator)
    scatter_index = index.view(5, 1).expand(5, 4)
    weights = torch.randn(5, generator=generator, dtype=torch.float64)
    samples = torch.randn(300, generator=generator)
    return {
        "index_reduce": lambda: self.index_reduce(0, index, source, "prod", include_self=False),
        "index_reduce_": lambda: self.clone().index_reduce_(0, index, source, "mean"),
        "index_reduce.out": lambda: torch.index_reduce(self, 0, index, source, "amax", out=torch.empty(0).double()),
        "scatter_reduce.two": lambda: self.scatter_reduce(0, scatter_index, source, "prod", include_self=False),
        "scatter_reduce_.two": lambda: self.clone().scatter_reduce_(0, scatter_index, source, "prod"),
        "scatter_reduce.two_out": lambda: torch.scatter_reduce(
            self, 0, scatter_index, source, "prod", out=torch.empty(0).double()
        ),
        "put_": lambda: self.clone().put_(index * 4 - 3, weights, accumulate=True),
        "median.dim_values": lambda: tuple(self.median(1)),
        "nanmedian.dim_values": lambda: tuple(self.nanmedian(0, keepdim=True)),
        "histc": lambda: torch.histc(samples, 10),
        "histc.out": lambda: torch.histc(samples, 7, -1, 1, out=torch.empty(0)),
        "bincount": lambda: torch.bincount(index, weights=weights, minlength=8),
    }


@needs_extension
def test_routes_reached_through_the_dispatcher_equal_pytorch(monkeypatch):
    """The routes installed at the CPU key (covering CPU here): the dispatcher hands them the aten op's
    arguments (keyword-only ones included) and their results equal PyTorch's kernels."""
    calls = _dispatcher_calls()
    expected = {name: call() for name, call in calls.items()}
    hits: list[str] = []
    for name in calls:
        route = registered_routes()[name]

        def counted(*args, _route=route, **kwargs):
            hits.append(_route.aten_op)
            return _route.deterministic(*args, **kwargs)

        monkeypatch.setitem(_routes._routes, name, Route(name, counted, lambda *args, **kwargs: None))
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    _routes.enable_routes("CPU")
    try:
        for name, call in calls.items():
            for got, want in zip(_as_tuple(call()), _as_tuple(expected[name])):
                _assert_matches(got, want)
            assert hits[-1] == name
    finally:
        _routes.disable_routes()
        torch.use_deterministic_algorithms(was)
    assert sorted(set(hits)) == sorted(calls)
    hits.clear()
    calls["histc"]()  # negative control: routing off, PyTorch's kernel
    assert hits == []


# ---- GPU: the routed aten ops under deterministic mode -------------------------------------------------


def _cuda_cases():
    """name -> (aten op, fn(device) -> tensor or tuple), on the probe's shapes and larger ones."""

    def data(device, *shape, seed=0, positive=True):
        generator = torch.Generator().manual_seed(seed)
        if positive:  # near 1: long products stay in range
            return (torch.rand(*shape, generator=generator, dtype=torch.float64) + 0.5).float().to(device)
        return torch.randn(*shape, generator=generator).to(device)

    def index(device, high, *shape, seed=1):
        return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed)).to(device)

    return {
        "index_reduce_prod": (
            "index_reduce",
            lambda d: data(d, 500, 3).index_reduce(0, index(d, 500, 20_000), data(d, 20_000, 3, seed=2), "prod"),
        ),
        "index_reduce_mean_no_self": (
            "index_reduce",
            lambda d: data(d, 500, 3).index_reduce(
                0, index(d, 500, 20_000), data(d, 20_000, 3, seed=2), "mean", include_self=False
            ),
        ),
        "index_reduce_amin": (
            "index_reduce",
            lambda d: data(d, 500, 3).index_reduce(0, index(d, 500, 20_000), data(d, 20_000, 3, seed=2), "amin"),
        ),
        "index_reduce__mean": (
            "index_reduce_",
            lambda d: data(d, 5, 3).index_reduce_(0, index(d, 5, 8), data(d, 8, 3, seed=2), "mean"),
        ),
        "scatter_reduce_prod": (
            "scatter_reduce.two",
            lambda d: data(d, 64, 8).scatter_reduce(0, index(d, 64, 4000, 8), data(d, 4000, 8, seed=2), "prod"),
        ),
        "put_accumulate": (
            "put_",
            lambda d: data(d, 50, 3).put_(index(d, 150, 20_000), data(d, 20_000, seed=2, positive=False), True),
        ),
        "median_dim": (
            "median.dim_values",
            lambda d: tuple(
                torch.randperm(300 * 257, generator=torch.Generator().manual_seed(3))
                .view(300, 257)
                .float()
                .to(d)
                .median(1)
            ),
        ),
        "nanmedian_dim": (
            "nanmedian.dim_values",
            lambda d: tuple(
                torch.randperm(300 * 257, generator=torch.Generator().manual_seed(4))
                .view(300, 257)
                .float()
                .where(torch.rand(300, 257, generator=torch.Generator().manual_seed(5)) > 0.3, float("nan"))
                .to(d)
                .nanmedian(1)
            ),
        ),
        "median_dim_ties": ("median.dim_values", lambda d: _median_ties(index(d, 7, 300, 257).float())),
        "histc": ("histc", lambda d: torch.histc(data(d, 100_000, positive=False), bins=64)),
        "histc_range": ("histc", lambda d: torch.histc(data(d, 100_000, positive=False), bins=10, min=-1, max=1)),
        "bincount_weights": (
            "bincount",
            lambda d: torch.bincount(index(d, 300, 100_000), weights=data(d, 100_000, seed=2, positive=False)),
        ),
    }


def _median_ties(values):
    """On CUDA the routed median; on CPU the documented rule: rank (n - 1) // 2 of the stable order."""
    if values.is_cuda:
        return tuple(values.median(1))
    order = torch.sort(values, dim=1, stable=True).indices[:, (values.shape[1] - 1) // 2]
    return values.gather(1, order[:, None])[:, 0], order


CUDA_CASES = _cuda_cases()


def _as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CUDA_CASES))
def test_routed_reduction_cuda_matches_cpu_and_repeats_bitwise(name, deterministic_routing):
    from deepep_lightning.ops._routes import installed_ops

    aten_op, fn = CUDA_CASES[name]
    assert aten_op in installed_ops()
    ours = _as_tuple(fn("cuda"))  # raises without the route: PyTorch refuses deterministic mode here
    for _ in range(20):
        assert all(torch.equal(a, b) for a, b in zip(_as_tuple(fn("cuda")), ours))
    oracle = _as_tuple(fn("cpu"))
    for got, want in zip(ours, oracle):
        if want.is_floating_point():  # float32 oracle summed in another order: a few roundings of the largest
            scale = want.abs().max().item() if want.numel() else 1.0
            torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4 * scale, equal_nan=True)
        else:
            assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["index_reduce_prod", "index_reduce_mean", "scatter_reduce_prod", "median_dim"])
def test_probe_forward_and_backward_cuda_do_not_raise(name, deterministic_routing):
    """The probe of benchmarks/list_refused_ops.py: forward + backward on small tensors in deterministic mode."""
    generator = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).cuda().requires_grad_()

    def index(high, *shape):
        return torch.randint(0, high, shape, generator=generator).cuda()

    if name == "median_dim":
        value = leaf(5, 7).median(1).values.sum()
    elif name == "scatter_reduce_prod":
        value = torch.ones(5, device="cuda").scatter_reduce(0, index(5, 8), leaf(8), "prod").sum()
    else:
        value = torch.ones(5, 3, device="cuda").index_reduce(0, index(5, 8), leaf(8, 3), name.split("_")[-1]).sum()
    value.backward()
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_route_runs_only_in_deterministic_mode_cuda(deterministic_routing, monkeypatch):
    def planted(*args, **kwargs):
        raise AssertionError("the deterministic histc ran")

    monkeypatch.setattr(histograms_module, "histc", planted)
    values = torch.randn(1000, device="cuda")
    torch.use_deterministic_algorithms(False)
    assert torch.equal(torch.histc(values, 10).cpu(), torch.histc(values.cpu(), 10))  # PyTorch's atomic kernel
    torch.use_deterministic_algorithms(True)
    with pytest.raises(AssertionError, match="the deterministic histc ran"):  # negative control: routed
        torch.histc(values, 10)
