"""CPU tests of deepep_lightning::ps_roi_align_backward (deepep_lightning/ops/ps_roi_align.py): the float64 oracle and
torchvision's CPU kernel agree with it, bad arguments are refused in Python, and the route on
``torchvision::_ps_roi_align_backward`` (installed at the CPU key here) serves ``ps_roi_align`` in
deterministic mode only."""

import dataclasses

import pytest
import torch

pytest.importorskip("torchvision")
import torchvision.ops  # noqa: E402

from deepep_lightning.ops import _routes, extension_available, routed_aten_ops  # noqa: E402
from deepep_lightning.ops.ps_roi_align import ps_roi_align_backward  # noqa: E402
from tests.ops._roi_oracle import ps_roi_align_backward_oracle  # noqa: E402

pytestmark = pytest.mark.skipif(not extension_available(), reason="deepep_lightning extension not buildable here")

ROUTE = "torchvision::_ps_roi_align_backward"


def _case(sampling_ratio, dtype=torch.float64, count=7, seed=0):
    generator = torch.Generator().manual_seed(seed)
    batch, channels_out, height, width, pooled = 2, 3, 11, 14, (2, 3)
    corners = torch.rand(count, 4, generator=generator, dtype=torch.float64) * 36 - 4
    x1, x2 = corners[:, 0].minimum(corners[:, 2]), corners[:, 0].maximum(corners[:, 2])
    y1, y2 = corners[:, 1].minimum(corners[:, 3]), corners[:, 1].maximum(corners[:, 3])
    index = torch.randint(0, batch, (count,), generator=generator).double()
    rois = torch.stack([index, x1, y1, x2, y2], dim=1).to(dtype)
    grad = torch.randn(count, channels_out, pooled[1], pooled[0], generator=generator, dtype=dtype).transpose(2, 3)
    mapping = torch.arange(channels_out * 6, dtype=torch.int32).view(1, channels_out, 2, 3).repeat(count, 1, 1, 1)
    return (grad, rois, mapping, 0.5, *pooled, sampling_ratio, batch, channels_out * 6, height, width)


@pytest.fixture(autouse=True)
def _restore_global_state():
    was = torch.are_deterministic_algorithms_enabled()
    yield
    _routes.disable_routes()
    torch.use_deterministic_algorithms(was)


@pytest.mark.parametrize("sampling_ratio", [2, -1])
def test_kernel_matches_the_float64_oracle_and_torchvision_cpu(sampling_ratio):
    args = _case(sampling_ratio)
    oracle_args = args[:2] + args[3:]
    result = ps_roi_align_backward(*args)
    torch.testing.assert_close(result, ps_roi_align_backward_oracle(*oracle_args), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(result, torch.ops.torchvision._ps_roi_align_backward(*args), rtol=1e-12, atol=1e-12)


def test_opcheck_and_empty_rois():
    args = _case(2, torch.float32)
    torch.library.opcheck(torch.ops.deepep_lightning.ps_roi_align_backward.default, args)
    empty = (torch.zeros(0, 3, 2, 3), torch.zeros(0, 5), torch.zeros(0, 3, 2, 3, dtype=torch.int32), *args[3:])
    assert torch.equal(ps_roi_align_backward(*empty), torch.zeros(2, 18, 11, 14))


def test_bad_arguments_raise_a_value_error_naming_them():
    args = list(_case(2))
    args[8] = 17
    with pytest.raises(ValueError, match="ps_roi_align_backward: channels 17 is not a multiple"):
        ps_roi_align_backward(*args)
    args = list(_case(2))
    args[2] = args[2].float()
    with pytest.raises(ValueError, match="channel_mapping must be an int32/int64"):
        ps_roi_align_backward(*args)


def test_route_serves_ps_roi_align_in_deterministic_mode_only(monkeypatch):
    assert ROUTE in routed_aten_ops()
    calls = []
    route = _routes.registered_routes()[ROUTE]
    monkeypatch.setitem(
        _routes._routes,
        ROUTE,
        dataclasses.replace(route, deterministic=lambda *a: calls.append(1) or route.deterministic(*a)),
    )
    features = torch.randn(2, 12, 9, 9, requires_grad=True, generator=torch.Generator().manual_seed(1))
    boxes = torch.tensor([[0, 1.0, 1.0, 7.0, 8.0], [1, 0.0, 2.0, 8.0, 5.0]])
    expected = torch.autograd.grad(torchvision.ops.ps_roi_align(features, boxes, 2, 1.0, -1).sum(), features)[0]
    _routes.enable_routes("CPU")
    torch.autograd.grad(torchvision.ops.ps_roi_align(features, boxes, 2, 1.0, -1).sum(), features)
    assert calls == []  # negative control: outside deterministic mode torchvision's kernel runs
    torch.use_deterministic_algorithms(True)
    routed = torch.autograd.grad(torchvision.ops.ps_roi_align(features, boxes, 2, 1.0, -1).sum(), features)[0]
    assert calls == [1]
    torch.testing.assert_close(routed, expected, rtol=1e-5, atol=1e-6)
