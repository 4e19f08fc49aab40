"""CPU tests of the deterministic roi_pool backward (deepep_lightning/ops/roi_pool.py): it equals torchvision's
CPU kernel, bad arguments are refused in Python, and the route on ``torchvision::_roi_pool_backward``
(installed at the CPU key here) serves ``roi_pool`` in deterministic mode only."""

import dataclasses

import pytest
import torch

pytest.importorskip("torchvision")
import torchvision.ops  # noqa: E402

from deepep_lightning.ops import _routes, extension_available, routed_aten_ops  # noqa: E402
from deepep_lightning.ops.roi_pool import roi_pool_backward  # noqa: E402

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")

ROUTE = "torchvision::_roi_pool_backward"


@pytest.fixture(autouse=True)
def _restore_global_state():
    was = torch.are_deterministic_algorithms_enabled()
    yield
    _routes.disable_routes()
    torch.use_deterministic_algorithms(was)


def _case(dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 5, 12, 15, generator=generator, dtype=dtype)
    rois = torch.tensor(
        [[0, 1.0, 1.0, 9.0, 8.0], [1, 0.0, 0.0, 14.0, 11.0], [0, 3.0, 2.0, 5.0, 4.0], [1, 20.0, 20.0, 30.0, 30.0]],
        dtype=dtype,
    )  # the last box is outside the map: empty bins, argmax -1
    _, argmax = torch.ops.torchvision.roi_pool(features.double(), rois.double(), 1.0, 3, 2)  # no CPU bfloat16
    grad = torch.randn(4, 5, 2, 3, generator=generator, dtype=dtype).transpose(2, 3)
    return (grad, rois, argmax, 1.0, 3, 2, 2, 5, 12, 15)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_equals_torchvision_cpu_kernel(dtype):
    args = _case(dtype)
    assert (args[2] == -1).any()
    expected = torch.ops.torchvision._roi_pool_backward(*args) if dtype != torch.bfloat16 else None
    if expected is None:
        expected = torch.ops.torchvision._roi_pool_backward(args[0].double(), args[1].double(), *args[2:]).to(dtype)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6  # the CPU scatter rounds each bfloat16 addition
    torch.testing.assert_close(roi_pool_backward(*args), expected, rtol=tolerance, atol=tolerance)


def test_empty_rois_and_bad_arguments():
    args = _case()
    empty = (torch.zeros(0, 5, 3, 2, dtype=torch.float64), torch.zeros(0, 5, dtype=torch.float64))
    empty += (torch.zeros(0, 5, 3, 2, dtype=torch.int32), *args[3:])
    assert torch.equal(roi_pool_backward(*empty), torch.zeros(2, 5, 12, 15, dtype=torch.float64))
    with pytest.raises(ValueError, match="roi_pool_backward: argmax dtype torch.float64"):
        roi_pool_backward(args[0], args[1], args[2].double(), *args[3:])
    with pytest.raises(ValueError, match=r"roi_pool_backward: argmax of shape \(4, 5, 3, 1\)"):
        roi_pool_backward(args[0], args[1], args[2][..., :1], *args[3:])


def test_route_serves_roi_pool_in_deterministic_mode_only(monkeypatch):
    assert ROUTE in routed_aten_ops()
    calls = []
    route = _routes.registered_routes()[ROUTE]
    monkeypatch.setitem(
        _routes._routes,
        ROUTE,
        dataclasses.replace(route, deterministic=lambda *a: calls.append(1) or route.deterministic(*a)),
    )
    features = torch.randn(2, 4, 10, 10, requires_grad=True, generator=torch.Generator().manual_seed(1))
    boxes = [torch.tensor([[1.0, 1.0, 7.0, 8.0]]), torch.tensor([[0.0, 2.0, 8.0, 5.0], [2.0, 2.0, 3.0, 3.0]])]
    expected = torch.autograd.grad(torchvision.ops.roi_pool(features, boxes, 3, 1.0).sum(), features)[0]
    _routes.enable_routes("CPU")
    torch.autograd.grad(torchvision.ops.roi_pool(features, boxes, 3, 1.0).sum(), features)
    assert calls == []  # negative control: outside deterministic mode torchvision's kernel runs
    torch.use_deterministic_algorithms(True)
    routed = torch.autograd.grad(torchvision.ops.roi_pool(features, boxes, 3, 1.0).sum(), features)[0]
    assert calls == [1]
    torch.testing.assert_close(routed, expected, rtol=0, atol=0)
