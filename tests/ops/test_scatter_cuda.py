"""GPU tests of deepep_lightning::segment_scatter_add, the index_add / scatter_add routes, and index_put_(accumulate)
under the plugin (PyTorch's own sorted kernel, not routed).

Run on the GPU machine: ``python -m pytest tests/ops/test_scatter_cuda.py -q``.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_kernels")]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# Tolerance against the float64 oracle, relative to the largest |oracle| (the sums are in double, rounded once).
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 1e-3, torch.bfloat16: 8e-3}

SHAPES = [  # (src shape, dim, size, description)
    ((1000,), 0, 10, "short segments"),
    ((200_000,), 0, 3, "hot rows: chunked segments, K > 32"),
    ((5000, 33), 0, 700, "rows with inner columns"),
    ((3, 4096, 5), 1, 17, "outer and inner dims"),
    ((64,), 0, 100_000, "more rows than entries: mostly empty rows"),
    ((4099,), 0, 1, "one row, a tail of 3 after full chunks"),
]


def _inputs(shape, dim, size, dtype, seed=0, skew=False):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    src = torch.randn(shape, device="cuda", generator=generator).to(dtype)
    if skew:  # half of the entries on row 0: one very long segment among short ones
        index = torch.randint(0, size, (shape[dim],), device="cuda", generator=generator)
        index[: shape[dim] // 2] = 0
    else:
        index = torch.randint(0, size, (shape[dim],), device="cuda", generator=generator)
    return src, index


def _oracle(src, index, size, dim, base=None, alpha=1.0):
    shape = list(src.shape)
    shape[dim] = size
    out = base.double().cpu().clone() if base is not None else torch.zeros(shape, dtype=torch.float64)
    return out.index_add_(dim, index.cpu(), src.double().cpu(), alpha=alpha)


def _assert_near_oracle(actual, oracle, dtype):
    scale = oracle.abs().max().clamp_min(1e-30).item()
    torch.testing.assert_close(actual.double().cpu(), oracle, rtol=0, atol=RTOL[dtype] * scale * 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim,size,description", SHAPES)
def test_segment_scatter_add_matches_oracle_and_repeats_bitwise(shape, dim, size, description, dtype):
    from deepep_lightning.ops.scatter import segment_scatter_add

    src, index = _inputs(shape, dim, size, dtype)
    ours = segment_scatter_add(src, index, size, dim)
    _assert_near_oracle(ours, _oracle(src, index, size, dim), dtype)
    for _ in range(20):
        assert torch.equal(segment_scatter_add(src, index, size, dim), ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_skewed_index_and_base_alpha(dtype):
    from deepep_lightning.ops.scatter import segment_scatter_add

    src, index = _inputs((300_000, 2), 0, 1000, dtype, skew=True)
    base = torch.randn(1000, 2, device="cuda").to(dtype)
    ours = segment_scatter_add(src, index, 1000, 0, base, -0.25)
    _assert_near_oracle(ours, _oracle(src, index, 1000, 0, base, -0.25), dtype)
    assert torch.equal(segment_scatter_add(src, index, 1000, 0, base, -0.25), ours)


def test_oracle_check_catches_a_lost_entry():
    """Negative control: dropping one entry's contribution fails the oracle comparison."""
    from deepep_lightning.ops.scatter import segment_scatter_add

    src, index = _inputs((5000, 33), 0, 700, torch.float32)
    ours = segment_scatter_add(src, index, 700)
    src_missing = src.clone()
    src_missing[17] = 0
    with pytest.raises(AssertionError):
        _assert_near_oracle(segment_scatter_add(src_missing, index, 700), _oracle(src, index, 700, 0), torch.float32)
    _assert_near_oracle(ours, _oracle(src, index, 700, 0), torch.float32)


def test_row_results_do_not_depend_on_other_rows():
    """A row's sum is the same bits whatever the other rows hold (chunks start at each segment's own start)."""
    from deepep_lightning.ops.scatter import segment_scatter_add

    src, index = _inputs((100_000,), 0, 50, torch.float32)
    ours = segment_scatter_add(src, index, 50)
    keep = index == 7
    alone = segment_scatter_add(src[keep], index[keep], 50)
    assert torch.equal(alone[7], ours[7])
    # More entries on lower rows shift row 7's segment in the sorted array, not its bits.
    extra = torch.zeros(12345, dtype=index.dtype, device="cuda")
    shifted = segment_scatter_add(torch.cat([torch.randn(12345, device="cuda"), src]), torch.cat([extra, index]), 50)
    assert torch.equal(shifted[7], ours[7])


def test_empty_and_non_contiguous_inputs():
    from deepep_lightning.ops.scatter import segment_scatter_add

    base = torch.randn(4, 3, device="cuda")
    empty = torch.empty(0, 3, device="cuda")
    assert torch.equal(segment_scatter_add(empty, torch.empty(0, dtype=torch.long, device="cuda"), 4, 0, base), base)
    assert segment_scatter_add(
        torch.empty(5, 0, device="cuda"), torch.zeros(5, dtype=torch.long, device="cuda"), 4
    ).shape == (4, 0)
    src = torch.randn(6, 40, device="cuda").t()  # [40, 6], not contiguous
    index = torch.randint(0, 4, (40,), device="cuda", dtype=torch.int32)
    _assert_near_oracle(segment_scatter_add(src, index, 4), _oracle(src, index.long(), 4, 0), torch.float32)


# ---- the routes: PyTorch's own ops in deterministic mode -----------------------------------------------------


def _index_add(self, index, source):
    return self.index_add(0, index, source, alpha=0.5)


def _index_add_dim1(self, index, source):
    return self.t().contiguous().index_add(1, index, source.t().contiguous()).t()


def _index_add_inplace(self, index, source):
    return self.clone().index_add_(0, index, source)


def _scatter_add(self, index, source):
    return self.scatter_add(0, index.view(-1, 1).expand(-1, self.shape[1]), source)


def _scatter_add_inplace(self, index, source):
    return self.clone().scatter_add_(0, index.view(-1, 1).expand(-1, self.shape[1]), source)


def _index_put(self, index, source):
    return self.clone().index_put_((index,), source, accumulate=True)


def _embedding_backward_like(self, index, source):  # index_put_ with broadcast values and two index tensors
    columns = torch.arange(self.shape[1], device=self.device).view(1, -1)
    return self.clone().index_put_((index.view(-1, 1), columns), source, accumulate=True)


ROUTED_OPS = {
    "index_add": (_index_add, "index_add"),
    "index_add_dim1": (_index_add_dim1, "index_add"),
    "index_add_": (_index_add_inplace, "index_add_"),
    "scatter_add": (_scatter_add, "scatter_add"),
    "scatter_add_": (_scatter_add_inplace, "scatter_add_"),
}


def _route_inputs(dtype=torch.float32, rows=1000, entries=200_000, features=8, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    self = torch.randn(rows, features, device="cuda", generator=generator).to(dtype)
    index = torch.randint(0, rows, (entries,), device="cuda", generator=generator)
    source = torch.randn(entries, features, device="cuda", generator=generator).to(dtype)
    return self, index, source


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(ROUTED_OPS))
def test_routed_op_matches_pytorch_and_repeats_bitwise(name, dtype, deterministic_routing):
    from deepep_lightning.ops._routes import installed_ops

    fn, aten_op = ROUTED_OPS[name]
    assert aten_op in installed_ops()
    self, index, source = _route_inputs(dtype)
    ours = fn(self, index, source)
    for _ in range(20):
        assert torch.equal(fn(self, index, source), ours)
    oracle = fn(self.double().cpu(), index.cpu(), source.double().cpu())
    _assert_near_oracle(ours, oracle, dtype)
    torch.use_deterministic_algorithms(False)  # PyTorch's atomic kernel, same inputs
    theirs = fn(self, index, source)
    # PyTorch's atomics round after every add (~200 per row here: sqrt(200) roundings in float16/bfloat16),
    # the deterministic kernel rounds its sum once: it must be no farther from the oracle than PyTorch.
    their_error = (theirs.double().cpu() - oracle).abs().max().item()
    our_error = (ours.double().cpu() - oracle).abs().max().item()
    assert our_error <= their_error + RTOL[dtype] * oracle.abs().max().item(), (our_error, their_error)


def test_route_is_the_deepep_kernel_and_off_outside_deterministic_mode(deterministic_routing):
    from deepep_lightning.ops.scatter import segment_scatter_add

    self, index, source = _route_inputs()
    routed = self.index_add(0, index, source)
    assert torch.equal(routed, segment_scatter_add(source, index, 1000, 0, self))
    torch.use_deterministic_algorithms(False)
    atomic = [self.index_add(0, index, source) for _ in range(5)]
    # Outside deterministic mode the route hands the call to PyTorch's atomic kernel (bits may vary).
    assert all(torch.allclose(a, routed, rtol=1e-5, atol=1e-4) for a in atomic)


def test_uncovered_cases_keep_pytorch_results(deterministic_routing):
    self = torch.zeros(10, dtype=torch.int64, device="cuda")
    index = torch.tensor([1, 1, 3], device="cuda")
    assert self.index_add(0, index, torch.ones(3, dtype=torch.int64, device="cuda")).tolist() == [0, 2, 0, 1] + [0] * 6
    values = torch.ones(3, device="cuda")
    mask = torch.zeros(10, dtype=torch.bool, device="cuda")
    mask[[2, 4, 6]] = True
    assert torch.zeros(10, device="cuda").index_put_((mask,), values, accumulate=True).sum().item() == 3


@pytest.mark.parametrize("name", ["index_add", "scatter_add"])
def test_routed_op_under_torch_compile(name, deterministic_routing):
    fn, _ = ROUTED_OPS[name]
    self, index, source = _route_inputs(entries=50_000)
    eager = fn(self, index, source)
    compiled = torch.compile(fn, fullgraph=False)
    # Inductor may decompose the op (index_add -> index_put with alpha applied first), so the bits can
    # differ from eager's by rounding; deterministic mode makes it fall back to the routed aten ops.
    first = compiled(self, index, source)
    for _ in range(3):
        assert torch.equal(compiled(self, index, source), first)
    torch.testing.assert_close(first, eager, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["index_add", "index_add_", "scatter_add"])
def test_routed_op_in_a_cuda_graph(name, deterministic_routing):
    fn, _ = ROUTED_OPS[name]
    self, index, source = _route_inputs(entries=50_000)
    eager = fn(self, index, source)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture (allocator, lazy init)
        fn(self, index, source)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn(self, index, source)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    source.mul_(2)  # the replay reads the new values
    graph.replay()
    assert torch.equal(captured, fn(self, index, source))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [_index_put, _embedding_backward_like], ids=["one_index", "two_indices_broadcast"])
def test_index_put_accumulate_under_the_plugin_is_pytorchs_kernel_and_repeats_bitwise(fn, dtype, deterministic_routing):
    """index_put_(accumulate=True), the backward of every advanced-indexing gather, is PyTorch's sorted kernel in
    both modes: under the plugin (deterministic mode, routes on) it repeats bitwise, equals the plain run's bits
    (no tax, no change of result) and is near the float64 oracle. Hot rows: 200,000 entries into 1000 rows."""
    from deepep_lightning.ops._routes import installed_ops

    assert "_index_put_impl_" not in installed_ops()
    self, index, source = _route_inputs(dtype)
    ours = fn(self, index, source)
    for _ in range(20):
        assert torch.equal(fn(self, index, source), ours)
    oracle = fn(self.double().cpu(), index.cpu(), source.double().cpu())
    # PyTorch sums each row's ~200 entries sequentially in float (opmath): a few hundred float32 roundings
    scale = oracle.abs().max().item()
    torch.testing.assert_close(ours.double().cpu(), oracle, rtol=0, atol=max(RTOL[dtype] * 4, 1e-4) * scale)
    torch.use_deterministic_algorithms(False)
    assert torch.equal(fn(self, index, source), ours)


@pytest.mark.parametrize("dim", [0, 1])
def test_inplace_index_add_writes_into_self_and_matches_the_functional_op(dim):
    """segment_scatter_add_ (the index_add_ route) sums into a contiguous self in place, into a non-contiguous
    one through a copy, and gives segment_scatter_add's bits either way."""
    from deepep_lightning.ops.scatter import segment_scatter_add

    generator = torch.Generator(device="cuda").manual_seed(dim)
    self = torch.randn(6, 300, 5, device="cuda", generator=generator)
    source_shape = [6, 300, 5]
    source_shape[dim] = 4000
    source = torch.randn(source_shape, device="cuda", generator=generator)
    index = torch.randint(0, self.shape[dim], (4000,), device="cuda", generator=generator)
    expected = segment_scatter_add(source, index, self.shape[dim], dim, self, 0.5)
    target = self.clone()
    pointer = target.data_ptr()
    torch.ops.deepep_lightning.segment_scatter_add_.default(target, source, index, dim, 0.5)
    assert target.data_ptr() == pointer and torch.equal(target, expected)
    strided = self.clone().transpose(0, 2).contiguous().transpose(0, 2)
    torch.ops.deepep_lightning.segment_scatter_add_.default(strided, source, index, dim, 0.5)
    assert torch.equal(strided, expected)


# ---- sort plans: one sort per live, unchanged index ------------------------------------------------------


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("entries,size", [(0, 5), (1000, 10), (200_000, 3), (64, 100_000), (300_000, 70_000)])
def test_cuda_sort_plan_is_the_cpu_plan(entries, size, index_dtype):
    from deepep_lightning.ops.sort_plans import segment_sort_plan, segment_sort_plan_reference

    generator = torch.Generator(device="cuda").manual_seed(entries)
    index = torch.randint(0, size, (entries,), device="cuda", generator=generator, dtype=index_dtype)
    plan = segment_sort_plan(index, size)
    assert plan.device == index.device and plan.dtype == torch.int32
    assert torch.equal(plan.cpu(), segment_sort_plan_reference(index.cpu(), size))
    assert torch.equal(plan.cpu(), segment_sort_plan(index.cpu(), size))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim,size,description", SHAPES)
def test_a_plan_gives_the_bits_of_the_sort_inline(shape, dim, size, description, dtype):
    from deepep_lightning.ops.scatter import segment_scatter_add
    from deepep_lightning.ops.sort_plans import segment_sort_plan

    src, index = _inputs(shape, dim, size, dtype)
    plan = segment_sort_plan(index, size)
    inline = segment_scatter_add(src, index, size, dim)
    for _ in range(20):
        assert torch.equal(segment_scatter_add(src, index, size, dim, plan=plan), inline)


def test_routes_sort_an_edge_row_once_and_again_after_a_write(deterministic_routing):
    """A 3-layer message-passing step through the routed aten ops: two sorts for six scatters. After an in-place
    write to edge_index the routes sort again and the sums follow the new index; the stale plan, passed by hand,
    gives other sums (the negative control)."""
    from deepep_lightning.ops.scatter import segment_scatter_add
    from deepep_lightning.ops.sort_plans import SORT_PLANS

    generator = torch.Generator(device="cuda").manual_seed(0)
    nodes, edges, features = 2000, 30_000, 16
    edge_index = torch.randint(0, nodes, (2, edges), device="cuda", generator=generator)
    x = torch.randn(nodes, features, device="cuda", generator=generator, requires_grad=True)

    def step():
        h = x
        for _ in range(3):
            messages = h.index_select(0, edge_index[0])
            h = torch.zeros_like(h).scatter_add_(0, edge_index[1].view(-1, 1).expand_as(messages), messages)
        (grad,) = torch.autograd.grad(h.square().sum(), x)
        return h.detach(), grad

    SORT_PLANS.clear()
    before = SORT_PLANS.sorts
    first = step()
    assert SORT_PLANS.sorts - before == 2
    for _ in range(5):
        assert all(torch.equal(a, b) for a, b in zip(step(), first))
    assert SORT_PLANS.sorts - before == 2
    old_plan = SORT_PLANS.plan(edge_index[1], nodes)
    edge_index[1, : edges // 2] = edge_index[1, edges // 2 :].flip(0)[: edges // 2]
    moved = step()
    assert SORT_PLANS.sorts - before == 4
    SORT_PLANS.enabled = False
    try:
        assert all(torch.equal(a, b) for a, b in zip(step(), moved))  # every call sorting inline: the same bits
    finally:
        SORT_PLANS.enabled = True
    values = torch.randn(edges, features, device="cuda", generator=generator)
    stale = segment_scatter_add(values, edge_index[1], nodes, plan=old_plan)
    assert not torch.equal(stale, segment_scatter_add(values, edge_index[1], nodes))


def test_no_plan_is_cached_or_read_while_capturing(deterministic_routing):
    """A captured scatter sorts inside the graph, so a replay after the index changes in place sums along the new
    index, even though an eager call cached a plan of the old one."""
    from deepep_lightning.ops.sort_plans import SORT_PLANS

    self, index, source = _route_inputs(entries=50_000)
    self.index_add(0, index, source)  # caches a plan of index on the current stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        self.index_add(0, index, source)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    sorts = SORT_PLANS.sorts
    with torch.cuda.graph(graph):
        captured = self.index_add(0, index, source)
    assert SORT_PLANS.sorts == sorts
    index.copy_(index.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    SORT_PLANS.enabled = False
    try:
        assert torch.equal(captured, self.index_add(0, index, source))
    finally:
        SORT_PLANS.enabled = True
