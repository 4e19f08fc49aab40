"""GPU tests of the deterministic bilinear interpolate (upsample) backward kernel.

Run on the GPU machine: ``python -m pytest tests/ops/test_interpolate_cuda.py -q``.
"""

import pytest
import torch
import torch.nn.functional as F
from _refused_cuda import _assert_close_relative, _atomic_backward

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_kernels")]

INTERPOLATE_CASES = [  # (N, C, H, W, kwargs)
    (2, 3, 16, 16, dict(scale_factor=2.0)),
    (4, 8, 33, 47, dict(size=(100, 70))),
    (2, 4, 64, 64, dict(size=(21, 30))),  # downsampling
    (2, 4, 17, 19, dict(scale_factor=2.3)),  # kernel scale 1/2.3, not H_out / H
    (2, 4, 17, 19, dict(scale_factor=2.3, recompute_scale_factor=True)),
    (1, 2, 8, 8, dict(size=(256, 256))),  # heavy overlap: 32x32 outputs per input pixel
]


@pytest.mark.parametrize(
    "case",
    INTERPOLATE_CASES
    + [
        (2, 3, 33, 65, dict(size=(70, 129))),  # partial 32 x 32 tiles in both directions
        (1, 2, 5, 40, dict(size=(600, 41))),  # > 128 output rows per tile: the row pass goes in chunks
        (2, 3, 100, 90, dict(size=(7, 11))),  # strong downsampling
        (3, 2, 1, 1, dict(size=(5, 4))),  # one input pixel
        (1, 4301, 8, 8, dict(scale_factor=0.5)),  # many small planes: 2 planes per block on an H200, one left over
        (1, 33797, 4, 4, dict(size=(2, 3))),  # 8 planes per block, 5 left over
    ],
)
@pytest.mark.parametrize("align_corners", [False, True])
def test_interpolate_matches_pytorch_and_repeats_bitwise(case, align_corners):
    from deepep_lightning.ops import interpolate

    n, c, h, w, kwargs = case
    x = torch.randn(n, c, h, w, device="cuda", requires_grad=True)
    kwargs = dict(kwargs, mode="bilinear", align_corners=align_corners)
    out = interpolate(x, **kwargs)
    torch.use_deterministic_algorithms(False)  # PyTorch's native kernel (the fixture restores the mode)
    assert torch.equal(out, F.interpolate(x.detach(), **kwargs))  # the forward is PyTorch's, bit for bit
    grad_output = torch.randn_like(out)
    (ours,) = torch.autograd.grad(out, x, grad_output, retain_graph=True)
    (again,) = torch.autograd.grad(out, x, grad_output)
    assert torch.equal(again, ours)
    (theirs,) = _atomic_backward(lambda x_: F.interpolate(x_, **kwargs), (x,), grad_output)
    _assert_close_relative(ours, theirs)
    x64 = x.detach().double().cpu().requires_grad_()
    oracle = torch.autograd.grad(F.interpolate(x64, **kwargs), x64, grad_output.double().cpu())[0]
    # float32 source indices carry ~ulp(H) absolute error in lambda, as PyTorch's float32 kernel does.
    _assert_close_relative(ours.double().cpu(), oracle, rtol=1e-4)


def test_interpolate_planes_per_block_do_not_change_a_bit():
    """A block does the same tile of 1-8 planes (more when there are many small planes): a plane's
    gradient must be the same bits whether it is computed among 33797 planes or among 5."""
    from deepep_lightning.ops import interpolate

    x = torch.randn(1, 33797, 4, 4, device="cuda", requires_grad=True)
    grad_output = torch.randn(1, 33797, 6, 7, device="cuda")
    (many,) = torch.autograd.grad(interpolate(x, size=(6, 7), mode="bilinear", align_corners=False), x, grad_output)
    few_x = x.detach()[:, 100:105].clone().requires_grad_()
    (few,) = torch.autograd.grad(
        interpolate(few_x, size=(6, 7), mode="bilinear", align_corners=False), few_x, grad_output[:, 100:105]
    )
    assert torch.equal(many[:, 100:105], few)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_interpolate_other_dtypes(dtype):
    from deepep_lightning.ops import interpolate

    x = torch.randn(2, 3, 17, 40, device="cuda", dtype=dtype, requires_grad=True)
    out = interpolate(x, scale_factor=2.3, mode="bilinear", align_corners=False)
    grad_output = torch.randn_like(out)
    ours = torch.autograd.grad(out, x, grad_output)[0].double()
    x64 = x.detach().double().requires_grad_()
    oracle = torch.autograd.grad(
        F.interpolate(x64, scale_factor=2.3, mode="bilinear", align_corners=False), x64, grad_output.double()
    )[0]
    _assert_close_relative(ours, oracle, rtol=1e-12 if dtype == torch.float64 else 2e-2)


def test_f_interpolate_takes_the_gather_backward_while_routed(deterministic_routing):
    """``F.interpolate`` / ``nn.Upsample`` in deterministic mode: PyTorch's own choice is its index-based
    decomposition (backward a sorted ``index_put_``); while routed they reach the native forward and the
    gather backward, bit for bit what :func:`interpolate` gives, and repeat bitwise."""
    from deepep_lightning.ops import interpolate, refused_ops_routing

    x = torch.randn(4, 16, 33, 41, device="cuda", requires_grad=True)
    kwargs = dict(size=(129, 161), mode="bilinear", align_corners=False)
    out = F.interpolate(x, **kwargs)
    assert "deepep_lightning" in out.grad_fn.name()
    upsampled = torch.nn.Upsample(**kwargs)(x)
    assert "deepep_lightning" in upsampled.grad_fn.name()
    grad_output = torch.randn_like(out)
    (routed,) = torch.autograd.grad(out, x, grad_output)
    (direct,) = torch.autograd.grad(interpolate(x, **kwargs), x, grad_output)
    assert torch.equal(routed, direct)
    for _ in range(5):
        assert torch.equal(torch.autograd.grad(F.interpolate(x, **kwargs), x, grad_output)[0], routed)
    with refused_ops_routing(False):  # negative control: PyTorch's decomposition, same math
        plain = F.interpolate(x, **kwargs)
        assert "deepep_lightning" not in plain.grad_fn.name()
        _assert_close_relative(torch.autograd.grad(plain, x, grad_output)[0], routed)
