"""CPU tests of the deterministic ps_roi_pool backward (deepep_lightning/ops/ps_roi_pool.py): it equals
torchvision's CPU kernel (rounded boxes, empty and clipped bins), bad arguments are refused in Python, and the
route on ``torchvision::_ps_roi_pool_backward`` (installed at the CPU key here) serves ``ps_roi_pool`` in
deterministic mode only."""

import dataclasses

import pytest
import torch

pytest.importorskip("torchvision")
import torchvision.ops  # noqa: E402

from deepep_lightning.ops import _routes, extension_available, routed_aten_ops  # noqa: E402
from deepep_lightning.ops.ps_roi_pool import ps_roi_pool_backward  # noqa: E402

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")

ROUTE = "torchvision::_ps_roi_pool_backward"


@pytest.fixture(autouse=True)
def _restore_global_state():
    was = torch.are_deterministic_algorithms_enabled()
    yield
    _routes.disable_routes()
    torch.use_deterministic_algorithms(was)


def _case(dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)
    rois = torch.tensor(
        [
            [0, 1.5, 0.5, 9.0, 8.0],  # .5 coordinates: roundf rounds them away from zero
            [1, 0.0, 0.0, 29.0, 25.0],  # beyond the last row and column: clipped to the map
            [0, 3.0, 2.0, 3.2, 2.1],  # smaller than a pixel: 1 x 1
            [1, 20.0, 20.0, 30.0, 30.0],  # outside: empty bins
            [0, -3.0, 4.0, 6.0, 7.0],
        ],
        dtype=dtype,
    )
    grad = torch.randn(5, 3, 3, 2, generator=generator, dtype=dtype).transpose(2, 3)  # [K, C_out, PH, PW]
    mapping = torch.arange(18, dtype=torch.int32).view(1, 3, 2, 3).repeat(5, 1, 1, 1)
    return (grad, rois, mapping, 0.5, 2, 3, 2, 18, 12, 14)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_box_extent_matches_torchvision_cpu_kernel(device):
    # torchvision's bins: bin_h = float(extent) / float(pooled), bin p = [floor(p * bin_h), ceil((p + 1) * bin_h)).
    # On CUDA a division by a Python scalar is a product with its reciprocal, an ulp off for about a third of
    # the extents at pooled = 3 (7 / 3 -> 2.3333335), which moves a bin edge by a pixel: every extent 1..60.
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    extent = torch.arange(1, 61, dtype=torch.float32)
    rois = torch.stack([torch.zeros(60), extent % 3, extent % 2, extent % 3 + extent, extent % 2 + extent], dim=1)
    grad = torch.randn(60, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    mapping = torch.arange(18, dtype=torch.int32).view(1, 2, 3, 3).repeat(60, 1, 1, 1)
    args = (grad, rois, mapping, 1.0, 3, 3, 1, 18, 64, 64)
    expected = torch.ops.torchvision._ps_roi_pool_backward(*args)
    on_device = [arg.to(device) if isinstance(arg, torch.Tensor) else arg for arg in args]
    torch.testing.assert_close(ps_roi_pool_backward(*on_device).cpu(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_equals_torchvision_cpu_kernel(dtype):
    args = _case(dtype)
    expected = torch.ops.torchvision._ps_roi_pool_backward(*args)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(ps_roi_pool_backward(*args), expected, rtol=1e-6, atol=1e-6)


def test_empty_rois_opcheck_and_bad_arguments():
    args = _case()
    empty = (torch.zeros(0, 3, 2, 3, dtype=torch.float64), torch.zeros(0, 5, dtype=torch.float64))
    empty += (torch.zeros(0, 3, 2, 3, dtype=torch.int32), *args[3:])
    assert torch.equal(ps_roi_pool_backward(*empty), torch.zeros(2, 18, 12, 14, dtype=torch.float64))
    op_args = (args[0], args[1], *args[3:])  # the op's schema has no channel_mapping
    torch.library.opcheck(torch.ops.deepep_lightning.ps_roi_pool_backward.default, op_args)
    with pytest.raises(ValueError, match="ps_roi_pool_backward: channels 17 is not a multiple of"):
        ps_roi_pool_backward(*args[:7], 17, *args[8:])


def test_route_serves_ps_roi_pool_in_deterministic_mode_only(monkeypatch):
    assert ROUTE in routed_aten_ops()
    calls = []
    route = _routes.registered_routes()[ROUTE]
    monkeypatch.setitem(
        _routes._routes,
        ROUTE,
        dataclasses.replace(route, deterministic=lambda *a: calls.append(1) or route.deterministic(*a)),
    )
    features = torch.randn(2, 8, 9, 9, requires_grad=True, generator=torch.Generator().manual_seed(1))
    boxes = torch.tensor([[0, 1.0, 1.0, 7.0, 8.0], [1, 0.0, 2.0, 8.0, 5.0]])
    expected = torch.autograd.grad(torchvision.ops.ps_roi_pool(features, boxes, 2, 1.0).sum(), features)[0]
    _routes.enable_routes("CPU")
    torch.autograd.grad(torchvision.ops.ps_roi_pool(features, boxes, 2, 1.0).sum(), features)
    assert calls == []  # negative control: outside deterministic mode torchvision's kernel runs
    torch.use_deterministic_algorithms(True)
    routed = torch.autograd.grad(torchvision.ops.ps_roi_pool(features, boxes, 2, 1.0).sum(), features)[0]
    assert calls == [1]
    torch.testing.assert_close(routed, expected, rtol=1e-6, atol=1e-6)
