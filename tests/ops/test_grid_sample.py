"""CPU tests of deepep_lightning.ops.grid_sample: drop-in forward, PyTorch's backward, delegation."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from deepep_lightning.ops import extension_available, grid_sample
from deepep_lightning.ops.grid_sample import grid_sample_unsupported_reason

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")

PADDINGS = ("zeros", "border", "reflection")
OUR_GRAD_FN = "deepep_lightning::GridSampleBilinear2d"  # the C++ autograd node (refused_ops.cpp)


def _inputs(dtype=torch.float64, n=2, c=3, h=5, w=6, out=(4, 7), spread=1.2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, dtype=dtype, generator=generator).requires_grad_()
    # spread > 1 puts points outside [-1, 1]: exercises padding and out-of-bounds corners.
    grid = ((torch.rand(n, *out, 2, dtype=dtype, generator=generator) * 2 - 1) * spread).requires_grad_()
    return x, grid


@pytest.mark.parametrize("padding_mode", PADDINGS)
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_and_backward_equal_pytorch(padding_mode, align_corners, dtype):
    x, grid = _inputs(dtype)
    ours = grid_sample(x, grid, padding_mode=padding_mode, align_corners=align_corners)
    theirs = F.grid_sample(x, grid, padding_mode=padding_mode, align_corners=align_corners)
    assert OUR_GRAD_FN in ours.grad_fn.name()  # our op ran, not a silent delegation
    assert torch.equal(ours, theirs)
    grad_output = torch.randn_like(ours)
    ours_grads = torch.autograd.grad(ours, (x, grid), grad_output)
    theirs_grads = torch.autograd.grad(theirs, (x, grid), grad_output)
    for mine, reference in zip(ours_grads, theirs_grads):
        assert torch.equal(mine, reference)


def test_heavy_overlap_matches_pytorch():
    # Every sample point lands in the same 2x2 pixel neighbourhood.
    x, _ = _inputs(h=8, w=8)
    grid = (torch.rand(2, 16, 16, 2, dtype=torch.float64) * 0.05 + 0.1).requires_grad_()
    ours = grid_sample(x, grid, align_corners=False)
    theirs = F.grid_sample(x, grid, align_corners=False)
    grad_output = torch.randn_like(ours)
    for mine, reference in zip(
        torch.autograd.grad(ours, (x, grid), grad_output), torch.autograd.grad(theirs, (x, grid), grad_output)
    ):
        assert torch.equal(mine, reference)


@pytest.mark.parametrize("needs", [(True, False), (False, True)])
def test_partial_requires_grad(needs):
    x, grid = _inputs()
    x.requires_grad_(needs[0])
    grid.requires_grad_(needs[1])
    out = grid_sample(x, grid, align_corners=True)
    out.sum().backward()
    assert (x.grad is not None) == needs[0]
    assert (grid.grad is not None) == needs[1]
    reference_leaf = x if needs[0] else grid
    expected = torch.autograd.grad(F.grid_sample(x, grid, align_corners=True).sum(), reference_leaf)[0]
    assert torch.equal(reference_leaf.grad, expected)


def test_gradcheck():
    x, grid = _inputs(n=1, c=2, h=4, w=4, out=(3, 3), spread=0.9)
    assert torch.autograd.gradcheck(
        lambda a, b: grid_sample(a, b, padding_mode="border", align_corners=False), (x, grid)
    )


def test_opcheck():
    x, grid = _inputs(n=1, c=2, h=4, w=5, out=(3, 2))
    torch.library.opcheck(
        torch.ops.deepep_lightning.grid_sample_bilinear2d.default,
        (x, grid, 1, False),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def test_align_corners_none_warns_like_pytorch():
    x, grid = _inputs()
    with pytest.warns(UserWarning, match="align_corners=False since 1.3.0"):
        ours = grid_sample(x, grid)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(ours, F.grid_sample(x, grid))


@pytest.mark.parametrize("mode", ["nearest", "bicubic"])
def test_uncovered_modes_delegate_to_pytorch(mode):
    x, grid = _inputs()
    out = grid_sample(x, grid, mode=mode, align_corners=False)
    assert OUR_GRAD_FN not in out.grad_fn.name()
    assert torch.equal(out, F.grid_sample(x, grid, mode=mode, align_corners=False))
    assert "mode" in grid_sample_unsupported_reason(x, grid, mode)


def test_5d_input_delegates():
    x = torch.randn(1, 2, 3, 4, 5, requires_grad=True)
    grid = torch.rand(1, 2, 2, 2, 3) * 2 - 1
    out = grid_sample(x, grid, align_corners=False)
    assert torch.equal(out, F.grid_sample(x, grid, align_corners=False))
    assert "4-D" in grid_sample_unsupported_reason(x, grid)


def test_bad_arguments_raise_pytorch_errors():
    x, grid = _inputs()
    with pytest.raises(ValueError, match="padding_mode"):
        grid_sample(x, grid, padding_mode="wrap", align_corners=False)
    with pytest.raises(ValueError, match="mode"):
        grid_sample(x, grid, mode="area", align_corners=False)
    with pytest.raises(RuntimeError):  # mixed dtypes: PyTorch's own check
        grid_sample(x, grid.float(), align_corners=False)
    # Shape errors are PyTorch's own, raised before the compiled op (an exception from inside it
    # crashed torch 2.11 on the GPU machine, BENCHMARKS.md "Known problem").
    with pytest.raises(RuntimeError, match="grid_sampler.*same batch size"):
        grid_sample(x, grid[:1], align_corners=False)
    with pytest.raises(RuntimeError, match="grid_sampler.*size 2 in last dimension"):
        grid_sample(x, torch.cat([grid, grid[..., :1]], dim=-1), align_corners=False)
    with pytest.raises(RuntimeError, match="grid_sampler.*non-empty spatial dimensions"):
        grid_sample(x[:, :, :0], grid, align_corners=False)
    int_input = torch.zeros(1, 1, 2, 2, dtype=torch.int64)
    assert "dtype" in grid_sample_unsupported_reason(int_input, torch.zeros(1, 1, 1, 2, dtype=torch.int64))


def test_covered_reason_is_none():
    x, grid = _inputs()
    assert grid_sample_unsupported_reason(x, grid, "bilinear", "reflection") is None


def test_torch_compile_fullgraph_smoke():
    from deepep_lightning.ops import interpolate

    def loss(x, grid):
        return interpolate(grid_sample(x, grid, align_corners=False), scale_factor=2.0, mode="bilinear").sum()

    x, grid = _inputs(torch.float32, n=1, c=2, h=5, w=5, out=(3, 3))
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    compiled_grads = torch.autograd.grad(compiled(x, grid), (x, grid))
    eager_grads = torch.autograd.grad(loss(x, grid), (x, grid))
    for mine, reference in zip(compiled_grads, eager_grads):
        assert torch.equal(mine, reference)
