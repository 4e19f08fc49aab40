"""CPU tests of deepep_lightning::segment_scatter_add and the index_add / scatter_add routes' arithmetic."""

import pytest
import torch

from deepep_lightning.ops import extension_available
from deepep_lightning.ops import scatter as scatter_module
from deepep_lightning.ops._routes import registered_routes
from deepep_lightning.ops.scatter import segment_scatter_add, segment_scatter_add_reference

needs_extension = pytest.mark.skipif(not extension_available(), reason="needs the compiled deepep_lightning extension")

CASES = [  # (src shape, dim, size)
    ((7,), 0, 5),
    ((9, 3), 0, 4),
    ((2, 11, 3), 1, 6),
    ((3, 5), 1, 2),
    ((0, 4), 0, 3),  # no entries: out = base
    ((4, 0), 0, 3),  # empty rows
]


def _inputs(shape, dim, size, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    src = torch.randn(shape, dtype=dtype, generator=generator)
    index = torch.randint(0, max(size, 1), (shape[dim],), generator=generator)
    out_shape = list(shape)
    out_shape[dim] = size
    base = torch.randn(out_shape, dtype=dtype, generator=generator)
    return src, index, base


@needs_extension
@pytest.mark.parametrize("shape,dim,size", CASES)
def test_matches_index_add(shape, dim, size):
    src, index, base = _inputs(shape, dim, size)
    for kwargs in ({}, {"base": base}, {"base": base, "alpha": -0.5}):
        ours = segment_scatter_add(src, index, size, dim, **kwargs)
        expected = (kwargs.get("base", torch.zeros_like(base))).clone()
        expected.index_add_(dim, index, src, alpha=kwargs.get("alpha", 1.0))
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)


@needs_extension
def test_a_moved_index_is_detected():
    """Negative control: the comparison above fails when one entry goes to another row."""
    src, index, _ = _inputs((9, 3), 0, 4)
    moved = index.clone()
    moved[0] = (moved[0] + 1) % 4
    assert not torch.allclose(segment_scatter_add(src, moved, 4), segment_scatter_add_reference(src, index, 4))


@needs_extension
def test_non_contiguous_and_int32_index():
    src = torch.randn(6, 8, dtype=torch.float64).t()  # [8, 6], not contiguous
    index = torch.tensor([3, 0, 3, 1, 1, 2, 0, 3], dtype=torch.int32)
    expected = torch.zeros(4, 6, dtype=torch.float64).index_add_(0, index, src)
    torch.testing.assert_close(segment_scatter_add(src, index, 4), expected)


@needs_extension
@pytest.mark.parametrize("shape,dim,size", CASES[:4])
def test_opcheck(shape, dim, size):
    src, index, base = _inputs(shape, dim, size)
    torch.library.opcheck(torch.ops.deepep_lightning.segment_scatter_add.default, (src, index, size, dim, None, 1.0))
    torch.library.opcheck(
        torch.ops.deepep_lightning.segment_scatter_add.default,
        (src.requires_grad_(), index, size, dim, base.requires_grad_(), 2.0),
    )


@needs_extension
def test_gradcheck():
    src, index, base = _inputs((2, 7, 3), 1, 4)
    src.requires_grad_()
    base.requires_grad_()
    torch.autograd.gradcheck(lambda s, b: segment_scatter_add(s, index, 4, 1, b, 0.5), (src, base))


@needs_extension
def test_torch_compile_cpu():
    src, index, base = _inputs((9, 3), 0, 4)
    compiled = torch.compile(lambda s, i, b: segment_scatter_add(s, i, 4, 0, b) * 2, backend="aot_eager")
    torch.testing.assert_close(compiled(src, index, base), segment_scatter_add(src, index, 4, 0, base) * 2)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(src=[1.0], index=torch.zeros(1, dtype=torch.long), size=1), TypeError, "src and index"),
        (dict(src=torch.ones(3), index=torch.zeros(3, dtype=torch.long), size=-1), TypeError, "size"),
        (dict(src=torch.ones(3), index=torch.zeros(3, dtype=torch.long), size=2.0), TypeError, "size"),
        (dict(src=torch.ones(3), index=torch.zeros(3, dtype=torch.long), size=2, dim=1), ValueError, "dim"),
        (
            dict(src=torch.ones(3, dtype=torch.long), index=torch.zeros(3, dtype=torch.long), size=2),
            ValueError,
            "float",
        ),
        (dict(src=torch.ones(3), index=torch.zeros(2, dtype=torch.long), size=2), ValueError, "index must be"),
        (dict(src=torch.ones(3), index=torch.zeros(3), size=2), ValueError, "index must be"),
        (
            dict(src=torch.ones(3), index=torch.zeros(3, dtype=torch.long), size=2, base=torch.ones(3)),
            ValueError,
            "base",
        ),
        (dict(src=torch.ones(()), index=torch.zeros(1, dtype=torch.long), size=2), ValueError, "at least 1"),
    ],
)
def test_bad_arguments_raise_in_python(kwargs, error, match):
    with pytest.raises(error, match=match):
        segment_scatter_add(**kwargs)


@needs_extension
def test_index_add_route_arithmetic_matches_pytorch():
    """The route functions run on CPU tensors too (the op's CPU kernel); they must equal PyTorch's ops."""
    generator = torch.Generator().manual_seed(1)
    self = torch.randn(5, 4, dtype=torch.float64, generator=generator)
    source = torch.randn(5, 7, dtype=torch.float64, generator=generator)
    index = torch.randint(0, 4, (7,), generator=generator)
    torch.testing.assert_close(
        scatter_module._index_add(self, -1, index, source, alpha=0.5), self.index_add(1, index, source, alpha=0.5)
    )
    target = self.clone()
    assert scatter_module._index_add_inplace(target, 1, index, source) is target
    torch.testing.assert_close(target, self.index_add(1, index, source))
    out = torch.empty(0, dtype=torch.float64)
    scatter_module._index_add_out(self, 1, index, source, out=out)
    torch.testing.assert_close(out, self.index_add(1, index, source))


@needs_extension
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_add_route_arithmetic_matches_pytorch(dim):
    generator = torch.Generator().manual_seed(2)
    self = torch.randn(5, 4, dtype=torch.float64, generator=generator).t()  # non-contiguous [4, 5]
    index = torch.randint(0, self.shape[dim], (3, 4), generator=generator)
    src = torch.randn(4, 6, dtype=torch.float64, generator=generator)
    torch.testing.assert_close(scatter_module._scatter_add(self, dim, index, src), self.scatter_add(dim, index, src))
    target = self.clone()
    scatter_module._scatter_add_inplace(target, dim, index, src)
    torch.testing.assert_close(target, self.scatter_add(dim, index, src))


def test_routes_are_registered_and_refuse_cpu_and_integers():
    routes = registered_routes()
    for name in ("index_add", "index_add_", "index_add.out", "scatter_add", "scatter_add_", "scatter_add.out"):
        assert name in routes
    # PyTorch's index_put_(accumulate=True) is deterministic in every mode: no route wraps it (scatter.py)
    assert "_index_put_impl_" not in routes
    index = torch.zeros(3, dtype=torch.long)
    assert routes["index_add"].covers(torch.zeros(2, 3), 1, index, torch.ones(2, 3)) is not None  # CPU
    meta = torch.zeros(4, device="meta", dtype=torch.int64)
    assert routes["index_add"].covers(meta, 0, index, meta) is not None  # integer self


@needs_extension
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_scatter_add_with_an_expanded_index_is_an_index_add_of_rows(dim):
    """An index repeating one row index across the other dims (PyG's ``index.view(-1, 1).expand_as(src)``)
    takes the row path (one sort key per row); a materialised copy of it, or one narrower than ``self``,
    takes the element path; all equal PyTorch's ``scatter_add``."""
    generator = torch.Generator().manual_seed(4)
    self = torch.randn(4, 5, 3, dtype=torch.float64, generator=generator)
    entries = 7
    shape = list(self.shape)
    shape[dim] = entries
    src = torch.randn(shape, dtype=torch.float64, generator=generator)
    row = torch.randint(0, self.shape[dim], (entries,), generator=generator)
    view = [1, 1, 1]
    view[dim] = entries
    expanded = row.view(view).expand(shape)
    assert torch.equal(scatter_module._row_index(self, dim, expanded), row)
    assert scatter_module._row_index(self, dim, expanded.contiguous()) is None  # materialised: element path
    narrow = [slice(None)] * 3
    narrow[(dim + 1) % 3] = slice(0, 1)
    assert scatter_module._row_index(self, dim, expanded[tuple(narrow)]) is None  # fewer columns than self
    for index in (expanded, expanded.contiguous(), expanded[tuple(narrow)]):
        expected = self.scatter_add(dim, index, src)
        torch.testing.assert_close(scatter_module._scatter_add(self, dim, index, src), expected, rtol=0, atol=1e-12)
        target = self.clone()
        pointer = target.data_ptr()
        assert scatter_module._scatter_add_inplace(target, dim, index, src) is target
        assert target.data_ptr() == pointer
        torch.testing.assert_close(target, expected, rtol=0, atol=1e-12)


@needs_extension
def test_segment_scatter_add_inplace_passes_opcheck():
    self, source = torch.randn(4, 6, 3), torch.randn(4, 5, 3)
    index = torch.tensor([0, 5, 5, 2, 0])
    torch.library.opcheck(torch.ops.deepep_lightning.segment_scatter_add_.default, (self, source, index, 1, 0.5))
