"""CPU tests of how deepep_lightning::grid_sample_bilinear2d / upsample_bilinear2d are registered: autograd in C++
(no Python per backward), fake kernels in Python; torch.library.opcheck and torch.compile see them whole."""

import pytest
import torch
from torch.library import opcheck

from deepep_lightning.ops import extension_available, grid_sample, interpolate

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")


def _grid_inputs(requires_grad=True):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 6, generator=generator, dtype=torch.float64)
    grid = torch.rand(2, 4, 7, 2, generator=generator, dtype=torch.float64) * 2.4 - 1.2
    return x.requires_grad_(requires_grad), grid.requires_grad_(requires_grad)


def test_backward_nodes_are_the_cpp_functions():
    x, grid = _grid_inputs()
    assert (
        grid_sample(x, grid, align_corners=False).grad_fn.name()
        == "torch::autograd::CppNode<deepep_lightning::GridSampleBilinear2d>"
    )
    up = interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
    assert up.grad_fn.name() == "torch::autograd::CppNode<deepep_lightning::UpsampleBilinear2d>"


@pytest.mark.parametrize("which", ["input_and_grid", "grid_only", "input_only"])
def test_grid_sample_only_computes_what_is_needed(which):
    x, grid = _grid_inputs()
    x.requires_grad_(which != "grid_only")
    grid.requires_grad_(which != "input_only")
    out = grid_sample(x, grid, padding_mode="border", align_corners=True)
    reference = torch.nn.functional.grid_sample(x, grid, padding_mode="border", align_corners=True)
    leaves = [t for t in (x, grid) if t.requires_grad]
    got = torch.autograd.grad(out.pow(2).sum(), leaves)
    want = torch.autograd.grad(reference.pow(2).sum(), leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_opcheck_grid_sample():
    x, grid = _grid_inputs()
    for padding_mode in (0, 1, 2):
        opcheck(torch.ops.deepep_lightning.grid_sample_bilinear2d.default, (x, grid, padding_mode, False))
    opcheck(torch.ops.deepep_lightning.grid_sample_bilinear2d.default, (x.detach(), grid, 0, True))


def test_opcheck_upsample():
    x, _ = _grid_inputs()
    opcheck(torch.ops.deepep_lightning.upsample_bilinear2d.default, (x, [9, 13], False, None, None))
    opcheck(torch.ops.deepep_lightning.upsample_bilinear2d.default, (x, [10, 12], True, None, None))
    opcheck(torch.ops.deepep_lightning.upsample_bilinear2d.default, (x, [3, 3], False, 0.5, 0.5))


def test_torch_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()

    def f(x, grid):
        return interpolate(grid_sample(x, grid, align_corners=False), scale_factor=2, mode="bilinear").sum()

    x, grid = _grid_inputs()
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(x, grid), (x, grid))
    want = torch.autograd.grad(f(x, grid), (x, grid))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
