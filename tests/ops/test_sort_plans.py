"""CPU tests of deepep_lightning::segment_sort_plan and the SortPlanCache that the scatter routes sort with.

The cache runs here with ``device_type="cpu"``: the same keys, version and liveness checks as on CUDA, with the
CPU plan op. The CUDA plan against this one, and reuse on the GPU: tests/ops/test_scatter_cuda.py.
"""

import gc

import pytest
import torch

from deepep_lightning.ops import extension_available
from deepep_lightning.ops import scatter as scatter_module
from deepep_lightning.ops.scatter import segment_scatter_add
from deepep_lightning.ops.sort_plans import SortPlanCache, segment_sort_plan, segment_sort_plan_reference

needs_extension = pytest.mark.skipif(not extension_available(), reason="needs the compiled deepep_lightning extension")


def _by_definition(index: torch.Tensor, size: int) -> list[int]:
    """The plan written out from its definition, with Python lists only."""
    values = index.tolist()
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    keys = [values[i] for i in order]
    starts = [sum(1 for k in keys if k < r) for r in range(size + 1)]
    return keys + order + starts


@needs_extension
@pytest.mark.parametrize(
    "values,size",
    [([2, 0, 2, 1, 0, 2], 3), ([], 4), ([0, 0, 0], 1), ([5, 1], 8), (list(range(9, -1, -1)), 10)],
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_plan_is_its_definition(values, size, dtype):
    index = torch.tensor(values, dtype=dtype)
    expected = _by_definition(index, size)
    for plan in (segment_sort_plan(index, size), segment_sort_plan_reference(index, size)):
        assert plan.dtype == torch.int32
        assert plan.tolist() == expected


@needs_extension
def test_plan_of_a_strided_view():
    base = torch.tensor([[3, 1, 3, 0], [9, 9, 9, 9]])
    column = base[:, 1:].t()[:, 0]  # non-contiguous, offset: [1, 3, 0]
    assert segment_sort_plan(column, 4).tolist() == _by_definition(column, 4)


@needs_extension
def test_opcheck():
    index = torch.tensor([2, 0, 2, 1])
    torch.library.opcheck(torch.ops.deepep_lightning.segment_sort_plan.default, (index, 3))
    src = torch.randn(4, 2, dtype=torch.float64)
    plan = segment_sort_plan(index, 3)
    torch.library.opcheck(torch.ops.deepep_lightning.segment_scatter_add.default, (src, index, 3, 0, None, 1.0, plan))


@needs_extension
def test_scatter_with_a_plan_is_the_scatter_without_and_checks_the_plan():
    generator = torch.Generator().manual_seed(0)
    src = torch.randn(11, 3, dtype=torch.float64, generator=generator)
    index = torch.randint(0, 5, (11,), generator=generator)
    plan = segment_sort_plan(index, 5)
    assert torch.equal(segment_scatter_add(src, index, 5, plan=plan), segment_scatter_add(src, index, 5))
    with pytest.raises(ValueError, match=r"plan must be segment_sort_plan\(index, 6\)"):
        segment_scatter_add(src, index, 6, plan=plan)  # a plan for another row count
    with pytest.raises(ValueError, match="plan must be"):
        segment_scatter_add(src, index, 5, plan=plan.long())


@pytest.mark.parametrize(
    "index,size,error,match",
    [
        ([0, 1], 2, TypeError, "index must be a tensor"),
        (torch.zeros(2, dtype=torch.long), 2.0, TypeError, "size must be an int"),
        (torch.zeros(2, dtype=torch.long), -1, ValueError, r"size must be in \[0, "),
        (torch.zeros(2), 2, ValueError, "index must be 1-D int64/int32"),
        (torch.zeros(2, 2, dtype=torch.long), 2, ValueError, "index must be 1-D int64/int32"),
    ],
)
def test_bad_plan_arguments_raise_in_python(index, size, error, match):
    with pytest.raises(error, match=match):
        segment_sort_plan(index, size)


@needs_extension
def test_an_index_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"index must lie in \[0, 3\)"):
        segment_sort_plan(torch.tensor([0, 3]), 3)


@needs_extension
def test_views_of_one_unchanged_index_share_a_plan():
    cache = SortPlanCache(device_type="cpu")
    edge_index = torch.tensor([[0, 1, 2, 2], [1, 2, 0, 1]])
    first = cache.plan(edge_index[1], 3)
    again = cache.plan(edge_index[1], 3)  # a new view object of the same row
    expanded = edge_index[1].view(-1, 1).expand(4, 5)
    rows = expanded.as_strided((4,), (expanded.stride(0),))  # what the scatter_add route sums along
    assert again is first and cache.plan(rows, 3) is first
    assert cache.sorts == 1
    assert first.tolist() == _by_definition(edge_index[1], 3)


@needs_extension
def test_other_rows_sizes_or_dtypes_get_their_own_plans():
    cache = SortPlanCache(device_type="cpu")
    edge_index = torch.tensor([[0, 1, 2, 2], [1, 2, 0, 1]])
    as_int32 = edge_index[1].int()
    plans = [
        cache.plan(edge_index[0], 3),
        cache.plan(edge_index[1], 3),
        cache.plan(edge_index[1], 4),
        cache.plan(as_int32, 3),
    ]
    assert cache.sorts == 4 and len(cache) == 4
    assert plans[0].tolist() == _by_definition(edge_index[0], 3)
    assert plans[2].tolist() == _by_definition(edge_index[1], 4)


@needs_extension
def test_a_write_through_any_view_makes_a_new_plan():
    """The stale-plan control: after an in-place write the old plan sums other rows than the index names."""
    cache = SortPlanCache(device_type="cpu")
    edge_index = torch.tensor([[0, 1, 2, 2], [1, 2, 0, 1]])
    old = cache.plan(edge_index[1], 3)
    edge_index[1, 0] = 2  # through another view of the same tensor
    new = cache.plan(edge_index[1], 3)
    assert cache.sorts == 2 and new is not old
    assert new.tolist() == _by_definition(edge_index[1], 3)
    assert old.tolist() != new.tolist()  # the old plan would have summed the wrong entries


@needs_extension
def test_a_plan_dies_with_its_index_and_new_memory_never_meets_it():
    cache = SortPlanCache(device_type="cpu")
    index = torch.tensor([1, 0, 1])
    cache.plan(index, 2)
    assert len(cache) == 1
    del index
    gc.collect()
    assert len(cache) == 0
    for _ in range(4):  # new tensors, often at the freed address: each gets its own plan
        index = torch.tensor([0, 1, 1])
        assert cache.plan(index, 2).tolist() == _by_definition(index, 2)


@needs_extension
def test_capacity_keeps_the_most_recent_plans():
    cache = SortPlanCache(capacity=2, device_type="cpu")
    indices = [torch.tensor([i % 3, 1]) for i in range(3)]
    for index in indices:
        cache.plan(index, 3)
    assert len(cache) == 2
    cache.plan(indices[0], 3)  # evicted: sorted again
    assert cache.sorts == 4
    cache.clear()
    assert len(cache) == 0


def test_nothing_is_cached_for_other_devices_inference_tensors_subclasses_or_when_off():
    cache = SortPlanCache()  # CUDA indices only
    assert cache.plan(torch.tensor([0, 1]), 2) is None
    cpu = SortPlanCache(device_type="cpu")
    with torch.inference_mode():
        inference = torch.tensor([0, 1])
    assert cpu.plan(inference, 2) is None

    class Marked(torch.Tensor):
        pass

    assert cpu.plan(torch.tensor([0, 1]).as_subclass(Marked), 2) is None
    cpu.enabled = False
    assert cpu.plan(torch.tensor([0, 1]), 2) is None
    assert cpu.sorts == 0


@pytest.mark.parametrize(
    "kwargs,match",
    [({"capacity": 0}, "capacity"), ({"capacity": True}, "capacity"), ({"device_type": "mps"}, "device")],
)
def test_bad_cache_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SortPlanCache(**kwargs)


@needs_extension
def test_three_gnn_layers_sort_each_edge_row_once(monkeypatch):
    """A 3-layer message-passing step through the dispatcher (the routes installed at the CPU key, in deterministic
    mode): per layer a ``scatter_add_`` of messages along the target row with PyG's expanded index, whose row view the
    route takes below autograd, and in the backward an ``index_add_`` along the source row. Two sorts for the whole
    step, and every sum equals PyTorch's. Run again after an in-place write to ``edge_index``: two new sorts."""
    from deepep_lightning.ops import _routes, routing

    cache = SortPlanCache(device_type="cpu")
    monkeypatch.setattr(scatter_module, "SORT_PLANS", cache)
    monkeypatch.setattr(scatter_module, "_route_reason", lambda self, *others: None)  # CPU tensors, CPU kernels
    routing.routed_aten_ops()
    generator = torch.Generator().manual_seed(1)
    nodes, edges, features = 6, 15, 4
    edge_index = torch.randint(0, nodes, (2, edges), generator=generator)
    x = torch.randn(nodes, features, dtype=torch.float64, generator=generator, requires_grad=True)

    def step():
        h = x
        for _ in range(3):
            messages = h.index_select(0, edge_index[0])
            target = edge_index[1].view(-1, 1).expand_as(messages)
            h = torch.zeros_like(h).scatter_add_(0, target, messages)
        return h, torch.autograd.grad(h.square().sum(), x)[0]

    expected = step()
    torch.use_deterministic_algorithms(True)
    _routes.enable_routes("CPU")
    try:
        routed = step()
        assert cache.sorts == 2
        edge_index[1, 0] = (edge_index[1, 0] + 1) % nodes
        moved = step()
        assert cache.sorts == 4
    finally:
        _routes.disable_routes()
    assert all(torch.equal(a, b) for a, b in zip(routed, expected))
    torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(moved, step()))
